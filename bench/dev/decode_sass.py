"""Dev: the SASS of the TMA decode kernels (bf16, head_dim 128, 3 stages; 4 and 8 warps) built here,
and their mma.sync loops (bench/dev/sass_loops.py). NVRTC gives PTX for compute_90a with the
library's options; ptxas and nvdisasm of NVRTC's version (the nvidia-cuda-nvcc and
nvidia-cuda-nvdisasm wheels; the system ptxas may be older than NVRTC's PTX) make the SASS. Session
53: the 4-warp kernel's tile loop holds 1433 instructions statically (32 HMMA; every branch of the
body, the options' included), while Nsight Compute counts about 400 executed per warp and 16-key
group (bench/NOTES.md).
Usage: python bench/dev/decode_sass.py [--bin DIR] [--out DIR]   (DIR: where ptxas and nvdisasm are)"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sass_loops import loops  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", help="the directory of ptxas and nvdisasm (default: the nvidia/cu13 wheel's)")
    p.add_argument("--out", default="/tmp", help="where the .ptx, .cubin and .sass files go")
    a = p.parse_args()
    from cupy_backends.cuda.libs import nvrtc

    from cuflash import _compile, _launch

    if a.bin is None:
        import nvidia

        a.bin = os.path.join(list(nvidia.__path__)[0], "cu13", "bin")
    opts = [o.replace("-arch=sm_90a", "-arch=compute_90a") for o in _compile.base_options("sm_90a")]
    files, _ = _compile.sources()
    headers = {n: t for n, t in files.items() if n.endswith(".cuh")}
    for warps in (4, 8):
        spec, _smem = _launch.decode_specialization("bfloat16", 128, 3, warps, True)
        prog = nvrtc.createProgram(files[spec.source] + "\n" + spec.checks + "\n", spec.source,
                                   [t.encode() for t in headers.values()], [n.encode() for n in headers])
        try:
            nvrtc.addNameExpression(prog, spec.expression)
            nvrtc.compileProgram(prog, opts)
            ptx = nvrtc.getPTX(prog)
        finally:
            nvrtc.destroyProgram(prog)
        stem = os.path.join(a.out, spec.name)
        with open(stem + ".ptx", "wb") as f:
            f.write(ptx if isinstance(ptx, bytes) else ptx.encode())
        subprocess.run([os.path.join(a.bin, "ptxas"), "-arch=sm_90a", "-o", stem + ".cubin", stem + ".ptx"],
                       check=True)
        sass = subprocess.run([os.path.join(a.bin, "nvdisasm"), "-c", stem + ".cubin"], check=True,
                              capture_output=True, text=True).stdout
        with open(stem + ".sass", "w") as f:
            f.write(sass)
        print(f"{spec.name}: {stem}.sass")
        print("\n".join(loops(stem + ".sass", "HMMA")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
