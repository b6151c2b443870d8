"""The TMA plumbing on a Hopper GPU (docs/hopper_plan.md step 1): tensor maps encoded by
cuflash/_tma.py through the driver, loaded by cuda_src/tma_probe.cu with tma.cuh's copies and
mbarriers, land in shared memory exactly as the SW128 panel layout the wgmma kernels read
(`_tma.expected_tile`, checked against an element-wise formula in tests/test_tma.py), with rows past
the tensor's end as zeros. Strided tensors (a slice of heads), every probe shape, tiles that start
past the end or before it. Marked gpu; skipped below sm_90."""

import numpy as np
import pytest

from _cpu_helpers import _ctx, _new_seed
from cuflash import _compile, _config, _launch, _tma

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def _hopper():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA copies with these maps need sm_90")


def _probe(x: "torch.Tensor", rows: int, row0: int, head: int, batch: int, blocks: int) -> np.ndarray:
    """Runs the probe on x (batch, seqlen, heads, head_dim): `blocks` tiles from row0; their bytes."""
    dev = x.device.index or 0
    panels = x.shape[3] // 64
    target = _config.compile_arch(*torch.cuda.get_device_capability(dev))
    spec, smem = _tma.probe_specialization(rows, panels), _tma.probe_smem_bytes(rows, panels)
    fn = _compile.get_function(spec, target, dev, smem)
    m = _tma.kv_map(x.data_ptr(), tuple(x.shape), tuple(x.stride()), rows,
                    {torch.float16: "float16", torch.bfloat16: "bfloat16"}[x.dtype])
    out = torch.full((blocks, rows * panels * 128), 0xAB, dtype=torch.uint8, device=x.device)  # not zeros
    p = np.zeros((), dtype=_tma.PROBE_PARAMS)
    p["map"] = np.frombuffer(m, np.uint8)
    p["row0"], p["head"], p["batch"] = row0, head, batch
    launch = _launch.Launch(spec.name, fn.ptr, blocks, 128, smem, p, {"out": out.data_ptr()}, dev)
    _launch.fire_all([launch], dev, torch.cuda.current_stream(dev).cuda_stream)
    torch.cuda.synchronize(dev)
    return out.cpu().numpy()


@pytest.mark.parametrize("head_dim, rows", [(64, 64), (128, 128), (256, 128)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "head_slice"])
def test_tma_tiles_land_in_the_sw128_layout(head_dim, rows, dtype, layout):
    _hopper()
    seed = _new_seed()
    g = torch.Generator(device="cpu").manual_seed(seed)
    tdt = getattr(torch, dtype)
    seqlen = 300  # not a multiple of the tile: the last tile runs past the end
    full = torch.randn(2, seqlen, 5, head_dim, generator=g).to(tdt).cuda()
    x = full if layout == "contiguous" else full[:, :, 1:4]  # strides (seqlen*5*d, 5*d, d, 1)
    host = x.cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    ctx = _ctx(seed, head_dim=head_dim, rows=rows, dtype=dtype, layout=layout, strides=tuple(x.stride()))
    for head, batch, row0 in ((0, 0, 0), (x.shape[2] - 1, 1, 37), (1, 1, seqlen - rows // 2)):
        blocks = -(-(seqlen - row0) // rows) + 1  # every tile to the end, then one wholly past it
        got = _probe(x, rows, row0, head, batch, blocks)
        for i in range(blocks):
            want = _tma.expected_tile(host, row0 + i * rows, rows, head, batch)
            bad = np.flatnonzero(got[i] != want)
            assert bad.size == 0, (f"tile {i} (rows from {row0 + i * rows}, head {head}, batch {batch}): {bad.size} "
                                   f"bytes differ, first at byte {bad[0] if bad.size else -1}; {ctx}")

