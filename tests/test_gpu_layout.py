"""GPU: the FwdParams mirror (with its nested MaskParams) read back from the device, field by field,
with a probe kernel compiled by the NVRTC used at run time (which may be too old for
__builtin_offsetof, see _compile)."""

import numpy as np
import pytest

from cuflash import _compile, _launch

pytestmark = pytest.mark.gpu


def _params_source():
    """common.cuh, mask.cuh and params.cuh as one translation unit (RawModule has no include path)."""
    files, _ = _compile.sources()
    parts = [files[n].replace("#pragma once", "") for n in ("common.cuh", "mask.cuh", "params.cuh")]
    return "\n".join(p.replace('#include "common.cuh"', "").replace('#include "mask.cuh"', "") for p in parts)


def test_params_offsets_from_probe_kernel():
    import cupy

    fields = list(_launch.FWD_PARAMS.names) + [f"mask.{n}" for n in _launch.MASK_PARAMS.names]
    body = "\n".join(
        f"    out[{i}] = (long long)((const char*)&p.{n} - (const char*)&p);" for i, n in enumerate(fields))
    code = (_params_source()
            + "\nextern \"C\" __global__ void probe(cuflash::FwdParams p, long long* out) {\n" + body
            + f"\n    out[{len(fields)}] = sizeof(cuflash::FwdParams);\n}}\n")
    mod = cupy.RawModule(code=code, options=("-std=c++17",))
    out = cupy.full(len(fields) + 1, -1, dtype=cupy.int64)
    p = np.zeros((), dtype=_launch.FWD_PARAMS)
    mod.get_function("probe")((1,), (1,), (p[()], out))
    got = cupy.asnumpy(out)
    mask_off = _launch.FWD_PARAMS.fields["mask"][1]
    expected = ([_launch.FWD_PARAMS.fields[n][1] for n in _launch.FWD_PARAMS.names]
                + [mask_off + _launch.MASK_PARAMS.fields[n][1] for n in _launch.MASK_PARAMS.names]
                + [_launch.FWD_PARAMS.itemsize])
    assert got.tolist() == expected


def test_struct_passed_by_value_reaches_the_kernel():
    """The launch path hands the struct to the kernel intact: read a few fields back."""
    import cupy

    code = (_params_source()
            + "\nextern \"C\" __global__ void echo(const __grid_constant__ cuflash::FwdParams p, long long* out) {\n"
              "    out[0] = p.o_head_stride; out[1] = p.seqlen_k; out[2] = p.num_m_blocks;\n"
              "    out[3] = (long long)(p.scale_log2 * 1000.f); out[4] = (long long)p.lse;\n"
              "    out[5] = p.mask.window_left; out[6] = (long long)(p.mask.softcap_log2 * 1000.f);\n"
              "    out[7] = p.mask.lse_head_stride;\n}\n")
    mod = cupy.RawModule(code=code, options=("-std=c++17",))
    out = cupy.zeros(8, dtype=cupy.int64)
    p = np.zeros((), dtype=_launch.FWD_PARAMS)
    p["o_head_stride"], p["seqlen_k"], p["num_m_blocks"], p["scale_log2"], p["lse"] = 123456789012, 77, 5, 1.5, 4096
    p["mask"]["window_left"], p["mask"]["softcap_log2"], p["mask"]["lse_head_stride"] = 37, 2.25, 98765432101
    mod.get_function("echo")((1,), (1,), (p[()], out))
    assert cupy.asnumpy(out).tolist() == [123456789012, 77, 5, 1500, 4096, 37, 2250, 98765432101]
