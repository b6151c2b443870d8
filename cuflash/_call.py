"""One call, described and validated: the first stage of the pipeline after the adapters.

    adapter (torch, JAX, CuPy, NumPy)  ->  Call (this module)  ->  Plan (_plan.py)  ->  run

An adapter turns each array argument into an `ArrayInfo` (library, shape, element strides, dtype,
device, alignment) and hands the scalars over as they came. `describe_forward` and
`describe_varlen` check everything and return a `Call`: the validated facts that decide which
kernels run, with the options normalized (causal folded into the window, bounds no row can reach
dropped). A call that uses no option, or only options that reduce to plain attention, is a Call
with `feats = None`: the plain kernels serve it.

Nothing here reads array values or touches a framework: the checks depend only on the call's
signature, so the adapters cache their result per signature (the values of CPU option arrays are
checked when the NumPy path runs, `_features.check_values_cpu`). Every error names the argument,
what it got and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._config import HEAD_DIMS
from ._features import ARRAY_OPTIONS, Features, _check_int, check_features

SUPPORTED_DTYPES = ("float16", "bfloat16")

# The kernels compute p = exp2(fma(s, scale * log2 e, -m)) with m the rounded product of the row
# max: exact to the rounding of |s * scale * log2 e|, so that logit must stay far below 2^24 in
# log2 units (NaN from 2^31 on: exp2 of the rounding residual overflows). With scales up to 1000
# and |q . k| up to ~100 a logit stays below 2^18 (p within 0.3 %); the fuzzer found NaN at 1e30.
MAX_SOFTMAX_SCALE = 1000.0
_NAMES = ("q", "k", "v")


@dataclass(frozen=True)
class ArrayInfo:
    """What validation and planning need to know of one array (made by its library's adapter)."""

    lib: str                   # "torch", "jax", "cupy" or "numpy"
    shape: tuple               # ints
    strides: tuple             # in elements
    dtype: str                 # "float16", "bfloat16", "float32", "int32", ...
    device: tuple              # ("cuda", ordinal), ("cpu", 0), ("traced", 0) under a JAX transformation, ...
    aligned: bool = True       # base pointer 16-byte aligned (device arrays)
    type_name: str = ""        # module.qualname of the array type, for messages


@dataclass(frozen=True)
class Foreign:
    """An argument that is not an array of a supported library."""

    type_name: str
    lib: None = None


@dataclass(frozen=True)
class Call:
    """A validated call. Hashable: plans are cached per (Call, layouts)."""

    lib: str
    device: tuple
    dtype: str
    batch: int
    seqlen_q: int          # padded length, or max_seqlen_q of a packed batch
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    scale: float
    causal: bool           # plain calls; a feature call has it folded into feats.window_right
    deterministic: bool
    feats: Features | None = None      # None: plain attention
    packed: tuple | None = None        # (max_seqlen_q, max_seqlen_k) for attention_varlen
    total_q: int = 0                   # rows of a packed q / k
    total_k: int = 0
    arrays: tuple = ()                 # the array options given, in ARRAY_OPTIONS order
    alibi_2d: bool = False             # alibi_slopes is (batch, nheads)

    @property
    def q_shape(self) -> tuple:
        if self.packed:
            return (self.total_q, self.nheads, self.head_dim)
        return (self.batch, self.seqlen_q, self.nheads, self.head_dim)

    @property
    def lse_shape(self) -> tuple:
        if self.packed:
            return (self.nheads, self.total_q)
        return (self.batch, self.nheads, self.seqlen_q)


def _type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def _check_bool(name, x):
    if not isinstance(x, bool) and type(x).__name__ != "bool_":
        raise TypeError(f"{name}: expected a bool; got {type(x).__name__}")
    return bool(x)


def _check_qkv(infos, causal, softmax_scale):
    """The checks every entry point shares, on 4-D infos. Returns (lib, device, dtype, scale)."""
    for name, x in zip(_NAMES, infos):
        if x.lib is None:
            raise TypeError(f"{name}: expected a torch.Tensor, jax.Array, cupy.ndarray or numpy.ndarray; "
                            f"got {x.type_name}")
    libs = [x.lib for x in infos]
    if len(set(libs)) != 1:
        got = ", ".join(f"{n} is {lib}" for n, lib in zip(_NAMES, libs))
        raise TypeError(f"q, k and v must come from one array library; got {got}")
    lib = libs[0]
    q, k, v = infos
    for name, x in zip(_NAMES, infos):
        if len(x.shape) != 4:
            layout = "(batch, seqlen_q, nheads, head_dim)" if name == "q" else "(batch, seqlen_k, nheads_kv, head_dim)"
            raise ValueError(f"{name}: expected 4 dimensions {layout}; got shape {x.shape}")
    for name, x in zip(_NAMES, infos):
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported; expected float16 or bfloat16")
    if len({x.dtype for x in infos}) != 1:
        raise TypeError(f"q, k and v must have one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")

    b, sq, h, d = q.shape
    bk, sk, hk, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}; got {v.shape}")
    if bk != b:
        raise ValueError(f"k: batch {bk} differs from q's batch {b} (q shape {q.shape}, k shape {k.shape})")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} differs from q's head_dim {d} (q shape {q.shape}, k shape {k.shape})")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim {d} is not supported; expected a multiple of 8 from 8 to 256 (q shape {q.shape})")
    if hk < 1 or h % hk != 0:
        raise ValueError(f"k: nheads_kv {hk} must divide q's nheads {h} (MQA/GQA); q shape {q.shape}, k shape {k.shape}")
    for name, x in (("q", q), ("k", k)):
        if min(x.shape) < 1:
            raise ValueError(f"{name}: every dimension must be at least 1; got shape {x.shape}")

    devices = [x.device for x in infos]
    # Under jax.grad only the differentiated arguments are traced: compare the concrete ones.
    concrete = [dv for dv in devices if dv[0] != "traced"]
    if len(set(concrete)) > 1:
        got = ", ".join(f"{n} on {dv[0]}:{dv[1]}" for n, dv in zip(_NAMES, devices))
        raise ValueError(f"q, k and v must be on one device; got {got}")
    device = concrete[0] if concrete else devices[0]
    if device[0] == "traced" and lib == "jax":
        pass  # under a JAX transformation: the JAX adapter decides what it supports
    elif device[0] not in ("cpu", "cuda"):
        raise ValueError(f"q: arrays on {device[0]} are not supported; expected a CUDA GPU or the CPU")

    _check_bool("causal", causal)
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        if isinstance(softmax_scale, (str, bytes, bool)) or not hasattr(softmax_scale, "__float__"):
            raise TypeError(f"softmax_scale: expected a float or None; got {type(softmax_scale).__name__}")
        scale = float(softmax_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale: expected a finite number > 0; got {softmax_scale!r}")
        if scale > MAX_SOFTMAX_SCALE:
            raise ValueError(f"softmax_scale: expected a number in (0, {MAX_SOFTMAX_SCALE:g}]; got {softmax_scale!r} "
                             "(a larger scale pushes the logits past the range in which the kernels' exp2 is "
                             "exact, and finite inputs could give NaN)")
    return lib, device, q.dtype, scale


def _given(options: dict) -> dict:
    """The array options that were given (name -> info), in ARRAY_OPTIONS order."""
    return {n: options[n] for n in ARRAY_OPTIONS if options.get(n) is not None}


def describe_forward(infos, causal, softmax_scale, deterministic, return_lse=False, *, window=None,
                     num_sink_tokens=0, softcap=None, **arrays) -> Call:
    """Validates a padded (4-D) call of `attention`. infos: the ArrayInfos (or Foreigns) of q, k, v;
    arrays: q_lengths, kv_lengths, sink_logits, alibi_slopes as ArrayInfo / Foreign / None."""
    lib, device, dtype, scale = _check_qkv(infos, causal, softmax_scale)
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    b, sq, h, d = infos[0].shape
    sk, hk = infos[1].shape[1], infos[1].shape[2]
    base = dict(lib=lib, device=device, dtype=dtype, batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hk,
                head_dim=d, scale=scale, deterministic=bool(deterministic))
    given = _given(arrays)
    if not given and window is None and softcap is None and type(num_sink_tokens) is int and num_sink_tokens == 0:
        return Call(causal=bool(causal), **base)
    feats, plain = check_features(lib, device, batch=b, nheads=h, seqlen_q=sq, seqlen_k=sk, causal=bool(causal),
                                  window=window, num_sink_tokens=num_sink_tokens, softcap=softcap, arrays=given,
                                  packed=False)
    if plain:
        return Call(causal=feats.window_right == 0, **base)  # a window (-1, 0) is causal attention
    return Call(causal=False, feats=feats, arrays=tuple(given), alibi_2d=_alibi_2d(given), **base)


def _alibi_2d(given) -> bool:
    a = given.get("alibi_slopes")
    return a is not None and len(a.shape) == 2


def _with_batch(x):
    """A 3-D (packed) info seen as the 4-D (1, total, heads, head_dim) the shared checks expect."""
    if x.lib is None:
        return x
    return ArrayInfo(x.lib, (1,) + x.shape, (0,) + x.strides, x.dtype, x.device, x.aligned, x.type_name)


def describe_varlen(infos, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                    deterministic, return_lse=False, *, window=None, num_sink_tokens=0, softcap=None,
                    **arrays) -> Call:
    """Validates a packed (3-D) call of `attention_varlen`: the checks of `attention` on the 4-D
    views, then the offsets and the options. cu_seqlens_*: ArrayInfo / Foreign."""
    for name, x in zip(_NAMES, infos):
        if x.lib is not None and len(x.shape) != 3:
            layout = "(total_q, nheads, head_dim)" if name == "q" else "(total_k, nheads_kv, head_dim)"
            raise ValueError(f"{name}: expected 3 dimensions {layout} (a packed batch); got shape {x.shape}")
    lib, device, dtype, scale = _check_qkv([_with_batch(x) for x in infos], causal, softmax_scale)
    mq = _check_int("max_seqlen_q", max_seqlen_q, 0)
    mk = _check_int("max_seqlen_k", max_seqlen_k, 0)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.lib is None:
            raise TypeError(f"{name}: expected an int32 {lib} array of shape (batch + 1,); got {cu.type_name}")
        if len(cu.shape) != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name}: expected shape (batch + 1,) with batch >= 1; got {cu.shape}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {cu_seqlens_q.shape}; "
                         f"got {cu_seqlens_k.shape}")
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    total_q, h, d = infos[0].shape
    total_k, hk = infos[1].shape[0], infos[1].shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    # No sequence is longer than the rows there are: a larger bound changes nothing but the grid and
    # the backward's per-row scratch (and past 2^31 the kernels' int32 lengths; found by the fuzzer).
    mq, mk = min(mq, total_q), min(mk, total_k)
    given = _given(dict(arrays, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
    feats, _ = check_features(lib, device, batch=batch, nheads=h, seqlen_q=mq, seqlen_k=mk, causal=bool(causal),
                              window=window, num_sink_tokens=num_sink_tokens, softcap=softcap, arrays=given,
                              packed=True)
    return Call(lib=lib, device=device, dtype=dtype, batch=batch, seqlen_q=mq, seqlen_k=mk, nheads=h, nheads_kv=hk,
                head_dim=d, scale=scale, causal=False, deterministic=bool(deterministic), feats=feats,
                packed=(mq, mk), total_q=total_q, total_k=total_k, arrays=tuple(given), alibi_2d=_alibi_2d(given))


def check_backward_arrays(call: Call, dout, out, lse) -> None:
    """The checks of `attention_backward` / `attention_varlen_backward` on dout, out and lse
    (ArrayInfo / Foreign) against a validated call."""
    lib, device = call.lib, call.device
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if x.lib != lib:
            raise TypeError(f"{name}: expected a {lib} array like q; got {x.type_name}")
        if x.device != device and "traced" not in (x.device[0], device[0]):
            raise ValueError(f"{name}: on {x.device[0]}:{x.device[1]}; expected q's device {device[0]}:{device[1]}")
    q_shape = call.q_shape
    for name, x in (("dout", dout), ("out", out)):
        if x.shape != q_shape:
            raise ValueError(f"{name}: expected q's shape {q_shape}; got {x.shape}")
        if x.dtype != call.dtype:
            raise TypeError(f"{name}: expected q's dtype {call.dtype}; got {x.dtype}")
    text = "(nheads, total_q)" if call.packed else "(batch, nheads, seqlen_q)"
    if lse.shape != call.lse_shape:
        raise ValueError(f"lse: expected shape {text} = {call.lse_shape}; got {lse.shape}")
    if lse.dtype != "float32":
        raise TypeError(f"lse: expected float32; got {lse.dtype}")
