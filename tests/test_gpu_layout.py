"""GPU: the FwdParams mirror read back from the device, field by field, with a probe kernel compiled
by the NVRTC used at run time (which may be too old for __builtin_offsetof, see _compile)."""

import numpy as np
import pytest

from cuflash import _compile, _launch

pytestmark = pytest.mark.gpu


def test_params_offsets_from_probe_kernel():
    import cupy

    files, _ = _compile.sources()
    fields = _launch.FWD_PARAMS.names
    body = "\n".join(
        f"    out[{i}] = (long long)((const char*)&p.{n} - (const char*)&p);" for i, n in enumerate(fields))
    code = (files["common.cuh"].replace("#pragma once", "") + files["params.cuh"].replace('#include "common.cuh"', "")
            .replace("#pragma once", "")
            + "\nextern \"C\" __global__ void probe(cuflash::FwdParams p, long long* out) {\n" + body
            + f"\n    out[{len(fields)}] = sizeof(cuflash::FwdParams);\n}}\n")
    mod = cupy.RawModule(code=code, options=("-std=c++17",))
    out = cupy.full(len(fields) + 1, -1, dtype=cupy.int64)
    p = np.zeros((), dtype=_launch.FWD_PARAMS)
    mod.get_function("probe")((1,), (1,), (p[()], out))
    got = cupy.asnumpy(out)
    expected = [_launch.FWD_PARAMS.fields[n][1] for n in fields] + [_launch.FWD_PARAMS.itemsize]
    assert got.tolist() == expected


def test_struct_passed_by_value_reaches_the_kernel():
    """The launch path hands the struct to the kernel intact: read a few fields back."""
    import cupy

    files, _ = _compile.sources()
    code = (files["common.cuh"].replace("#pragma once", "") + files["params.cuh"].replace('#include "common.cuh"', "")
            .replace("#pragma once", "")
            + "\nextern \"C\" __global__ void echo(const __grid_constant__ cuflash::FwdParams p, long long* out) {\n"
              "    out[0] = p.o_head_stride; out[1] = p.seqlen_k; out[2] = p.num_m_blocks;\n"
              "    out[3] = (long long)(p.scale_log2 * 1000.f); out[4] = (long long)p.lse;\n}\n")
    mod = cupy.RawModule(code=code, options=("-std=c++17",))
    out = cupy.zeros(5, dtype=cupy.int64)
    p = np.zeros((), dtype=_launch.FWD_PARAMS)
    p["o_head_stride"], p["seqlen_k"], p["num_m_blocks"], p["scale_log2"], p["lse"] = 123456789012, 77, 5, 1.5, 4096
    mod.get_function("echo")((1,), (1,), (p[()], out))
    assert cupy.asnumpy(out).tolist() == [123456789012, 77, 5, 1500, 4096]
