# Sourced by the session call scripts (bench/dev/s3*_call.sh): to the repository root, OUT made, the
# carried kernel cache (.cache/cf.tgz or .cache/cf.txz) unpacked and pointed at, the GPU named.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-./out}"
mkdir -p "$OUT" .cache
[ -f .cache/cf.tgz ] && tar -C .cache -xzf .cache/cf.tgz
[ -f .cache/cf.txz ] && tar -C .cache -xJf .cache/cf.txz  # xz: a third of gzip's size (the 64 MiB carry limit)
export CUFLASH_CACHE_DIR="$PWD/.cache/cf" PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
N="${CALL:-c}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

run_suite() {  # the quick GPU suite on this tree: the log to $OUT/${N}_suite.log, its last line printed
  python3 -m pytest -m "gpu and not slow" -q -rf -n 8 -p no:cacheprovider tests > "$OUT/${N}_suite.log" 2>&1
  echo "suite: $(tail -n 1 "$OUT/${N}_suite.log")"
}
