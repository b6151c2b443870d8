#!/usr/bin/env bash
# Builds cuflash's kernel cache for a GPU machine on a machine without one, to carry there (the
# device tool's `carry`), so that the GPU run starts with every kernel compiled: its precompile then
# loads cubins (seconds) instead of compiling hundreds of specializations.
#
#   bash scripts/carry_cache.sh [DIR] [TARGET] [NVRTC_VERSION]
#     DIR            where the cache goes (default .cache/cf; point CUFLASH_CACHE_DIR there on the GPU)
#     TARGET         NVRTC target (default sm_90a: H100 / H200)
#     NVRTC_VERSION  the GPU machine's NVRTC, major.minor (default 13.0). The cache key holds NVRTC's
#                    major.minor, so the cubins must come from that version: this script fetches the
#                    matching nvidia-cuda-nvrtc wheel and loads it in place of the local one.
#
# Also writes DIR.tgz (gzip; 32 MB of cubins pack to about 9 MB): carry that instead of DIR when the
# tracked tree plus DIR would pass the device tool's 64 MiB (session 34: 35.5 MB tracked), and unpack
# it there first: mkdir -p .cache && tar -C .cache -xzf .cache/cf.tgz.
#
# Builds what scripts/device_check.sh precompiles (the tests' head dims, both dtypes, causal on and
# off, backward, the feature and decode kernels). Needs the package's Python environment (PYTHON,
# default python3) with cupy and pip, and the package index.

set -euo pipefail
DIR="${1:-.cache/cf}"
TARGET="${2:-sm_90a}"
VER="${3:-13.0}"
PY="${PYTHON:-python3}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps -d "$WORK" "nvidia-cuda-nvrtc==${VER}.*"
"$PY" -m zipfile -e "$WORK"/nvidia_cuda_nvrtc-*.whl "$WORK/x"
LIB="$(dirname "$(find "$WORK/x" -name 'libnvrtc.so.*' ! -name '*alt*' | head -n 1)")"
mkdir -p "$DIR"
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LD_PRELOAD="$(ls "$LIB"/libnvrtc.so.* | grep -v alt | head -n 1)" \
CUFLASH_CACHE_DIR="$DIR" PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$TARGET" "$VER" <<'PYEOF'
import sys
import time

from cuflash import _compile
import cuflash

target, want = sys.argv[1], sys.argv[2]
got = ".".join(map(str, _compile.nvrtc_version()))
if got != want:
    sys.exit(f"loaded NVRTC {got}, expected {want}")
t = time.perf_counter()
names = cuflash.precompile(head_dims=[8, 32, 40, 64, 72, 96, 128, 136, 200, 256], features=True,
                           dtypes=["float16", "bfloat16"], causal=[False, True], backward=True, target=target)
print(f"{len(names)} specializations for {target} with NVRTC {got} in {time.perf_counter() - t:.0f} s "
      f"-> {_compile.cache_dir()}")
PYEOF
du -sh "$DIR"
tar -C "$(dirname "$DIR")" -czf "$DIR.tgz" "$(basename "$DIR")"
du -sh "$DIR.tgz"
