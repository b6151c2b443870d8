"""Worker process for parallel compilation (see _gpu.compile_many).

NVRTC holds the GIL through CuPy's bindings, so compiles overlap only across processes. A worker
is started as ``python -m cuflash._compile_worker``, independent of the parent's __main__ (which may
be a notebook or stdin), reads a pickled list of (Specialization, target) from stdin, compiles each
into the disk cache, and writes a pickled list of (name, compile_seconds, ptxas_log) to stdout.
"""

import pickle
import sys

from cuflash import _compile


def main() -> None:
    jobs = pickle.load(sys.stdin.buffer)
    results = []
    for spec, target in jobs:
        ck = _compile.compile_cached(spec, target)
        results.append((spec.name, ck.compile_seconds, ck.ptxas_log))
    pickle.dump(results, sys.stdout.buffer)


if __name__ == "__main__":
    main()
