"""Plans: what a validated call of one signature runs, prepared once and run many times.

    adapter  ->  Call (_call.py)  ->  Plan (this module)  ->  run

A `Plan` is made from a `Call` and the layouts of its arrays (`ArrayInfo`s: shapes, element
strides, alignment). On the GPU it holds the prepared launches (`_launch.Launch`: the loaded
kernel, grid, block, shared memory and a Params struct filled except for its pointers) and says
which inputs must be copied first (a last dimension that is not unit-stride, or a pointer or
stride that is not 16-byte aligned). On the CPU it runs the NumPy implementation of the same
tiled algorithm. The plain kernels serve a Call with `feats = None`; the feature kernels the rest.

Running a GPU plan takes a stream handle and the call's pointers, by slot:

    forward   Q K V OUT LSE, then the option arrays (ARRAY_OPTIONS order; 0 = absent)
    backward  DOUT Q K V OUT LSE DQ DK DV SCRATCH, then the option arrays

and does nothing but write them into the Params bytes and call cuLaunchKernel, under the plan's
lock (two threads may share a plan). Allocating the outputs and finding the caller's stream is the
adapter's part: it knows the library. The backward plan of a forward plan is made on first use,
per layout of dout / out / lse, and kept with it.

Adapters keep plans in `CACHE`, keyed by their own signature tuples (cheap to build from the
arrays, and equal only when the Call and the layouts are equal).
"""

from __future__ import annotations

import operator
import threading

from . import _config, _launch
from ._call import ArrayInfo, Call
from ._features import ARRAY_OPTIONS, check_values_cpu
from ._launch import DeviceTensor, MaskArgs, Slot

Q, K, V, OUT, LSE = range(5)
FWD_OPT = 5                                            # first option slot of a forward
B_DOUT, B_Q, B_K, B_V, B_OUT, B_LSE, B_DQ, B_DK, B_DV, B_SCRATCH = range(10)
BWD_OPT = 10                                           # first option slot of a backward
NO_OPTIONS = (0,) * len(ARRAY_OPTIONS)

_NEG_INF_BITS = 0xFF800000

# The plan cache: adapter signature -> Plan. Bounded so that a stream of new shapes cannot grow it
# without end (each plan holds a few kB); cleared, not evicted, since rebuilding one is cheap
# once its kernels are loaded.
CACHE: dict = {}
CACHE_LIMIT = 4096


def remember(key, plan: "Plan") -> "Plan":
    if len(CACHE) >= CACHE_LIMIT:
        CACHE.clear()
    CACHE[key] = plan
    return plan


def _taker(names: tuple):
    """A function of a mapping that returns its values of `names` as a tuple, in that order."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    if names:
        name = names[0]
        return lambda opts: (opts[name],)
    return lambda opts: ()


def needs_copy(info: ArrayInfo) -> bool:
    """True when the kernels cannot read a q / k / v / out / dout array in place: the last dimension
    is not unit-stride, or the base pointer or a row / head / batch step is not 16-byte aligned
    (cp.async and TMA move 16 bytes)."""
    s = info.strides
    return s[-1] != 1 or not info.aligned or any(x % 8 != 0 for x in s[:-1])


def _small_needs_copy(info: ArrayInfo) -> bool:
    """An option array (lengths, offsets, slopes, sink logits) needs a unit last stride."""
    return info.strides[-1] != 1 and info.shape[-1] > 1


def contiguous_strides(shape) -> tuple:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _cc(device_id: int):
    from ._gpu import compute_capability

    return compute_capability(device_id)


def _current_device() -> int:
    global _current_device
    import cupy

    _current_device = cupy.cuda.runtime.getDevice  # bound once: this runs on every call
    return _current_device()


class Plan:
    """The forward of one call signature (and, on demand, its backward plans)."""

    def __init__(self, call: Call, infos: dict):
        self.call = call
        self.on_gpu = call.device[0] == "cuda"
        self.device_id = call.device[1]
        self.out_shape = call.q_shape
        self.lse_shape = call.lse_shape
        self.has_sink = "sink_logits" in call.arrays
        self.options = call.arrays                      # names of the option arrays the call passes
        # Fixed by the signature, so that an adapter holding the option arrays in `options` order
        # writes their pointers without looking names up on each call: where each one's pointer
        # goes among the option slots (from FWD_OPT / BWD_OPT on); option_pad, where those slots
        # follow each other (a packed batch's two offsets, one option, ...), the zeros before the
        # first (option_pad, then the pointers in `options` order, are the option slots), else
        # None; where sink_logits is among them (-1: absent); and a function taking them from a
        # name -> array mapping (a C itemgetter where it can be).
        self.option_index = tuple(ARRAY_OPTIONS.index(n) for n in self.options)
        rel = self.option_index
        self.option_pad = (0,) * rel[0] if rel and rel[-1] - rel[0] == len(rel) - 1 else None
        self.sink_index = self.options.index("sink_logits") if self.has_sink else -1
        self.take_options = _taker(self.options)
        self.infos = infos                              # the layouts planned for (q, k, v, options)
        self._backward: dict = {}
        self._lock = threading.Lock()
        self.state: dict = {}                           # per-plan objects an adapter keeps (templates, ...)
        self.launches = ()
        self.launches_no_lse = ()
        self.copy = ()
        if self.on_gpu:
            self.copy = tuple(n for n in ("q", "k", "v") if needs_copy(infos[n]))
            self.copy += tuple(n for n in call.arrays if _small_needs_copy(infos[n]))
            self.launches = tuple(self._gpu_forward(infos))
            # With LSE = 0 the forward kernels write no lse (FwdParams::lse may be null), and the
            # packed batch's lse tail fill is left out: a call that wants out alone allocates no lse.
            self.launches_no_lse = tuple(L for L in self.launches if L is not self._lse_tail)

    # ---------------------------------------------------------------- GPU
    def _layout(self, infos, name, slot) -> DeviceTensor:
        info = infos[name]
        strides = contiguous_strides(info.shape) if name in self.copy else info.strides
        return DeviceTensor(Slot(slot), info.shape, strides)

    _lse_tail = None

    def _gpu_forward(self, infos):
        c = self.call
        cc = _cc(self.device_id)
        q, k, v = (self._layout(infos, n, s) for n, s in (("q", Q), ("k", K), ("v", V)))
        o = DeviceTensor(Slot(OUT), self.out_shape, contiguous_strides(self.out_shape))
        if c.feats is None:
            return _launch.fwd_launches(q, k, v, o, Slot(LSE), c.dtype, c.causal, c.scale, self.device_id, cc)
        m = _mask_args(c, self.copy, infos, FWD_OPT)
        if not c.packed:
            return _launch.fwd_launches(q, k, v, o, Slot(LSE), c.dtype, False, c.scale, self.device_id, cc, mask=m)
        mq, mk = c.packed
        b = c.batch
        launches = _launch.fwd_launches(_packed4(q, b, mq), _packed4(k, b, mk), _packed4(v, b, mk),
                                        _packed4(o, b, mq), Slot(LSE), c.dtype, False, c.scale, self.device_id, cc,
                                        mask=m)
        # Rows no sequence owns, and rows of a sequence past max_seqlen_q: out 0, lse -inf. The
        # warp-specialized forward fills them itself (mask.cuh fill_packed_tail): no launch for them.
        if any(L.name.startswith("fwd90ws_") for L in launches):
            return launches
        launches += _launch.tail_launches(o, m.cu_seqlens_q, b, mq, "u16", 0, self.device_id, cc)
        lse_rows = DeviceTensor(Slot(LSE), (c.total_q, c.nheads, 1), (1, c.total_q, 1))
        lse_tail = _launch.tail_launches(lse_rows, m.cu_seqlens_q, b, mq, "u32", _NEG_INF_BITS, self.device_id, cc)
        self._lse_tail = lse_tail[0] if lse_tail else None
        return launches + lse_tail

    def launch(self, stream: int, ptrs, lse_tail: bool = True) -> None:
        """Runs the prepared launches with these pointers (by slot) on the stream. ptrs[LSE] = 0
        runs the forward without lse. lse_tail=False writes lse only where the attention kernels
        write it, leaving out a packed batch's lse tail fill (rows no sequence owns, rows past
        max_seqlen_q): for an lse that only the backward reads (an autograd node's own), which
        reads lse at those rows of each sequence the forward visited and nowhere else."""
        run_launches(self, stream, ptrs, self.launches if ptrs[LSE] and lse_tail else self.launches_no_lse)

    def backward_plan(self, key, infos: dict) -> "BackwardPlan":
        """The backward for this forward and a layout of dout / out / lse (infos: their ArrayInfos;
        q, k, v and the options as in the forward). key: the adapter's signature of that layout."""
        bp = self._backward.get(key)
        if bp is None:
            bp = self._backward[key] = BackwardPlan(self, infos)
        return bp

    # ---------------------------------------------------------------- CPU
    def forward_numpy(self, q, k, v, arrays: dict):
        """The NumPy path: (out, lse) as NumPy arrays. arrays: option name -> NumPy array."""
        import numpy as np

        from ._cpu import attention_forward_numpy

        c = self.call
        if c.feats is None:
            return attention_forward_numpy(q, k, v, c.causal, c.scale)
        _check_values(c, arrays)
        kw = _cpu_kwargs(c, arrays)
        if not c.packed:
            return attention_forward_numpy(q, k, v, False, c.scale, q_lengths=arrays.get("q_lengths"),
                                           kv_lengths=arrays.get("kv_lengths"), alibi_slopes=arrays.get("alibi_slopes"),
                                           **kw)
        total_q, h, d = q.shape
        out = np.zeros(q.shape, dtype=q.dtype)
        lse = np.full((h, total_q), -np.inf, dtype=np.float32)
        for b, (q0, q1, k0, k1) in enumerate(_segments(arrays)):
            if q1 == q0:
                continue
            if k1 == k0:  # rows that see no key: out 0, lse the sink logit (or -inf)
                if arrays.get("sink_logits") is not None:
                    lse[:, q0:q1] = arrays["sink_logits"][:, None]
                continue
            o_b, l_b = attention_forward_numpy(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], False, c.scale,
                                               alibi_slopes=_alibi_row(arrays, b), **kw)
            out[q0:q1] = o_b[0]
            lse[:, q0:q1] = l_b[0]
        return out, lse

    def backward_numpy(self, dout, q, k, v, out, lse, arrays: dict):
        """The NumPy backward: (dq, dk, dv, dsink or None)."""
        import numpy as np

        from ._cpu_backward import attention_backward_numpy

        c = self.call
        if c.feats is None:
            dq, dk, dv = attention_backward_numpy(dout, q, k, v, out, lse, c.causal, c.scale)
            return dq, dk, dv, None
        _check_values(c, arrays)
        kw = _cpu_kwargs(c, arrays)
        sink = arrays.get("sink_logits") is not None
        if not c.packed:
            g = attention_backward_numpy(dout, q, k, v, out, lse, False, c.scale, q_lengths=arrays.get("q_lengths"),
                                         kv_lengths=arrays.get("kv_lengths"), alibi_slopes=arrays.get("alibi_slopes"),
                                         **kw)
            return g[0], g[1], g[2], (g[3] if sink else None)
        dq, dk, dv = (np.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
        dsink = np.zeros(q.shape[1], dtype=np.float32) if sink else None
        for b, (q0, q1, k0, k1) in enumerate(_segments(arrays)):
            if q1 == q0 or k1 == k0:
                continue  # no score: nothing flows to q, k or v (nor to the sink: out = 0 there)
            g = attention_backward_numpy(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                         out[None, q0:q1], lse[None, :, q0:q1], False, c.scale,
                                         alibi_slopes=_alibi_row(arrays, b), **kw)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
            if sink:
                dsink += g[3]
        return dq, dk, dv, dsink


def scratch_layout(c: Call, target: str, has_sink: bool) -> tuple:
    """The backward's float32 scratch for a call on a compile target: (atomic dQ, rows, dQ accumulator,
    sink rows) element counts, laid out in that order (delta [+ lse * log2 e], dq_accum, the per-row
    terms of d sink_logits). JAX under jit sizes its scratch output with it at trace time."""
    d, batch, h = c.head_dim, c.batch, c.nheads
    if c.feats is None:
        atomic = _launch.bwd_uses_atomics(c.deterministic, target, d)
        if _launch.bwd_uses_single(target, d, c.dtype, batch, h, c.seqlen_q, c.seqlen_k):
            return atomic, 0, 0, 0  # the one-launch backward needs no scratch
        n_rows, n_acc = _launch.bwd_scratch_sizes(batch, h, c.seqlen_q, d, atomic, target)
        return atomic, n_rows, n_acc, 0
    # dQ by float atomics from sm_90a's wgmma dK/dV kernel where it fits, unless deterministic.
    atomic = _config.feat_bwd_uses_atomics(c.deterministic, target, d)
    pad = _launch.bwd_row_pad(c.seqlen_q)
    n_rows = max(1, 2 * batch * h * pad)
    acc_dim = _config.bwd_pad_head_dim(target, d) or d  # the kernel's head_dim under pad-up
    return atomic, n_rows, batch * h * pad * acc_dim if atomic else 0, batch * h * pad if has_sink else 0


def _gradients(ptrs, empty_like, out_t, kv_t) -> tuple:
    """dq = empty_like(out_t), dk and dv = empty_like(kv_t) (the caller library's allocator and
    templates), their pointers written into ptrs' gradient slots."""
    dq, dk, dv = empty_like(out_t), empty_like(kv_t), empty_like(kv_t)
    ptrs[B_DQ], ptrs[B_DK], ptrs[B_DV] = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    return dq, dk, dv


class BackwardPlan:
    """The backward of a forward plan for one layout of dout, out and lse: which inputs are copied,
    the scratch it needs (one float32 buffer: delta [+ lse * log2 e], the dQ accumulator of the
    atomic path, the per-row sink gradients), and the prepared launches."""

    def __init__(self, fwd: Plan, infos: dict):
        infos = dict(fwd.infos, **infos)
        c = self.call = fwd.call
        self.device_id = fwd.device_id
        self.has_sink = fwd.has_sink
        self.options = fwd.options
        self.state: dict = {}
        self._lock = threading.Lock()
        self.launches = ()
        self.first = self.rest = self.late = ()
        self.copy = ()
        self.scratch_floats = 0
        self.dsink_offset = 0
        self.dsink_shape = ()
        if not fwd.on_gpu:
            return
        self.copy = tuple(n for n in ("dout", "q", "k", "v", "out") if needs_copy(infos[n]))
        self.copy += tuple(n for n in c.arrays if n in fwd.copy)
        if infos["lse"].strides != contiguous_strides(infos["lse"].shape):
            self.copy += ("lse",)
        self.launches = tuple(self._gpu_backward(infos))
        # The preprocess first, before the gradients exist (launch_split): it reads dout, out and lse
        # and writes the scratch only. The launches after it that share its Params buffer
        # (share_params) read dq, dk and dv from words it patched, which launch_split writes again.
        lead = self.launches[0] if self.launches else None
        if type(lead) is _launch.Launch and lead.name.startswith("bwd_pre_"):
            self.first, self.rest = self.launches[:1], self.launches[1:]
            self.late = tuple(p for p in lead.patches if p[1] in (B_DQ, B_DK, B_DV))

    def launch_split(self, stream: int, ptrs, empty_like, out_t, kv_t) -> tuple:
        """The backward with its gradients allocated here: dq = empty_like(out_t), dk and dv =
        empty_like(kv_t) (the caller library's allocator and templates; an allocation error is the
        caller library's), their pointers written into ptrs' gradient slots (0 on the way in). Where
        `first` is set, the preprocess fires before the gradients exist; then their pointers go into
        ptrs and into the preprocess's Params words that later launches share, and the rest fire, under
        one hold of the lock, so that no other call's pointers come between. Otherwise, or where the
        plan's device is not the current one: allocations, then run_launches (which switches).
        Returns (dq, dk, dv)."""
        if self.first:
            with self._lock:
                if _current_device() == self.device_id:
                    launch = self.first[0]
                    try:
                        launch.fire(stream, ptrs)
                    except Exception as e:
                        raise _launch_error(self, launch, None, e) from e
                    dq, dk, dv = _gradients(ptrs, empty_like, out_t, kv_t)
                    words = launch.words
                    for word, slot, add in self.late:
                        words[word] = ptrs[slot] + add
                    try:
                        for launch in self.rest:
                            launch.fire(stream, ptrs)
                    except Exception as e:
                        raise _launch_error(self, launch, None, e) from e
                    return dq, dk, dv
        dq, dk, dv = _gradients(ptrs, empty_like, out_t, kv_t)
        run_launches(self, stream, ptrs, self.launches)
        return dq, dk, dv

    def _layout(self, infos, name, slot):
        info = infos[name]
        strides = contiguous_strides(info.shape) if name in self.copy else info.strides
        return DeviceTensor(Slot(slot), info.shape, strides)

    def _gpu_backward(self, infos):
        c = self.call
        cc = _cc(self.device_id)
        target = _config.compile_arch(*cc)
        views = {n: self._layout(infos, n, s) for n, s in
                 (("dout", B_DOUT), ("q", B_Q), ("k", B_K), ("v", B_V), ("out", B_OUT))}
        grads = {n: DeviceTensor(Slot(s), infos[src].shape, contiguous_strides(infos[src].shape))
                 for n, s, src in (("dq", B_DQ, "q"), ("dk", B_DK, "k"), ("dv", B_DV, "v"))}
        batch, h = c.batch, c.nheads
        scratch = Slot(B_SCRATCH)
        atomic, n_rows, n_acc, n_sink = scratch_layout(c, target, self.has_sink)
        self.scratch_floats = n_rows + n_acc + n_sink
        if c.feats is None:
            return _launch.bwd_launches(views["dout"], views["q"], views["k"], views["v"], views["out"], Slot(B_LSE),
                                        grads["dq"], grads["dk"], grads["dv"], scratch,
                                        scratch + 4 * n_rows if n_acc else 0, c.dtype, c.causal, c.scale, atomic,
                                        self.device_id, cc)
        dsink = 0
        if self.has_sink:  # (no rows where every sequence is empty: d sink_logits is then zeros)
            self.dsink_offset, self.dsink_shape = n_rows + n_acc, (batch, h, _launch.bwd_row_pad(c.seqlen_q))
            dsink = scratch + 4 * self.dsink_offset
        m = _mask_args(c, self.copy, infos, BWD_OPT, dsink=dsink)
        acc = scratch + 4 * n_rows if atomic else 0
        if not c.packed:
            return _launch.bwd_launches(views["dout"], views["q"], views["k"], views["v"], views["out"], Slot(B_LSE),
                                        grads["dq"], grads["dk"], grads["dv"], scratch, acc, c.dtype, False, c.scale,
                                        atomic, self.device_id, cc, mask=m)
        mq, mk = c.packed
        p4 = [_packed4(views[n], batch, mq if n in ("dout", "q", "out") else mk) for n in ("dout", "q", "k", "v", "out")]
        g4 = [_packed4(grads[n], batch, mq if n == "dq" else mk) for n in ("dq", "dk", "dv")]
        launches = _launch.bwd_launches(*p4, Slot(B_LSE), *g4, scratch, acc, c.dtype, False, c.scale, atomic,
                                        self.device_id, cc, mask=m)
        for name, cu, max_len in (("dq", m.cu_seqlens_q, mq), ("dk", m.cu_seqlens_k, mk), ("dv", m.cu_seqlens_k, mk)):
            launches += _launch.tail_launches(grads[name], cu, batch, max_len, "u16", 0, self.device_id, cc)
        return launches

    def launch(self, stream: int, ptrs) -> None:
        run_launches(self, stream, ptrs, self.launches)


class LaunchError(RuntimeError):
    """A kernel launch the driver refused: names the specialization, its launch shape and the call."""


def run_launches(plan, stream: int, ptrs, launches, what=None, pdl: bool = True, pdl_first: bool = True) -> None:
    """Fires launches of a plan on the stream, under the plan's lock, with its device current (switched
    only when it is not: the switch costs more than the launch). A launch the driver refuses raises
    LaunchError naming the kernel and the call (the outputs the caller allocated are then its to
    drop). what: a function giving the call's description for that message (default: the attention
    call of plan.call); only called on an error. pdl=False: plain launches only (Launch.fire);
    pdl_first=False: the first launch plain, the others as pdl says."""
    launch = None
    try:
        with plan._lock:
            if _current_device() == plan.device_id:
                for launch in launches:
                    launch.fire(stream, ptrs, pdl and (pdl_first or launch is not launches[0]))
            else:
                import cupy

                with cupy.cuda.Device(plan.device_id):
                    for launch in launches:
                        launch.fire(stream, ptrs, pdl and (pdl_first or launch is not launches[0]))
    except Exception as e:
        if launch is None:
            raise
        raise _launch_error(plan, launch, what, e) from e


def _launch_error(plan, launch, what, e) -> LaunchError:
    return LaunchError(
        f"cuflash: launching {launch.name} failed (grid {launch.grid}, {launch.threads} threads, "
        f"{launch.smem} B shared memory, device {plan.device_id}) for "
        f"{what() if what is not None else _call_text(plan.call)}: {type(e).__name__}: {e}")


def _call_text(c: Call) -> str:
    shape = (f"q {c.q_shape}, k/v ({c.total_k if c.packed else c.batch}, "
             f"{'' if c.packed else f'{c.seqlen_k}, '}{c.nheads_kv}, {c.head_dim})")
    return f"{c.dtype} {shape}, causal={c.causal}, options={'none' if c.feats is None else c.feats}"


def _mask_args(c: Call, copy: tuple, infos: dict, base: int, dsink=0) -> MaskArgs:
    """The feature kernels' MaskParams: the options' pointers as slots from `base` on."""
    f = c.feats
    ptrs = {n: Slot(base + i) if n in c.arrays else 0 for i, n in enumerate(ARRAY_OPTIONS)}
    alibi_bs = 0
    if c.alibi_2d:
        a = infos["alibi_slopes"]
        alibi_bs = contiguous_strides(a.shape)[0] if "alibi_slopes" in copy else a.strides[0]
    return MaskArgs(alibi_batch_stride=alibi_bs, dsink_rows=dsink, window_left=f.window_left,
                    window_right=f.window_right, num_sink_tokens=f.num_sink_tokens, softcap=f.softcap,
                    total_q=c.total_q if c.packed else c.seqlen_q, total_k=c.total_k if c.packed else c.seqlen_k,
                    **ptrs)


def _packed4(t: DeviceTensor, batch: int, max_len: int) -> DeviceTensor:
    """(total, heads, d) -> the 4-D (batch, max_len, heads, d) view the kernels index, batch stride 0:
    each sequence adds its cu_seqlens offset itself."""
    return DeviceTensor(t.ptr, (batch, max_len) + tuple(t.shape[1:]), (0,) + tuple(t.strides))


# ---- NumPy path helpers: a packed batch runs one sequence at a time ----

def _check_values(c: Call, arrays: dict) -> None:
    check_values_cpu(arrays, c.packed is not None, c.seqlen_q, c.seqlen_k, c.total_q, c.total_k)


def _cpu_kwargs(c: Call, arrays: dict) -> dict:
    f = c.feats
    return dict(window=(f.window_left, f.window_right), num_sink_tokens=f.num_sink_tokens, softcap=f.softcap,
                sink_logits=arrays.get("sink_logits"))


def _segments(arrays):
    cq, ck = (arrays[n].astype("int64") for n in ("cu_seqlens_q", "cu_seqlens_k"))
    return [(int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])) for b in range(len(cq) - 1)]


def _alibi_row(arrays, b):
    s = arrays.get("alibi_slopes")
    return None if s is None else (s if s.ndim == 1 else s[b])
