#!/usr/bin/env bash
# Session 33's device call: the GPU test files TESTS; then bench_decode.py once per DECODE_RUNS entry
# ("name|ENV=V ENV2=V2|bench_decode args", ";"-separated; $OUT/d_<name>.json and .log), compared by
# bench/dev/decode_variants_cmp.py; bench_host.py (HOST=1); the quick GPU suite SUITE_RUNS times.
# Everything under $OUT goes into $OUT/all.tgz (the device tool returns 8 files at most). Carry:
# .cache/cf.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
. "$(dirname "${BASH_SOURCE[0]}")/call_lib.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "cuda_src md5 $(md5sum cuda_src/*.cu cuda_src/*.cuh | sort | md5sum | cut -c1-12)"
python3 -c "from cuflash import _gpu; print(f'peak memory bandwidth {_gpu.peak_memory_bandwidth(0) / 1e12:.3f} TB/s')"
run_tests
IFS=';' read -ra RUNS <<< "${DECODE_RUNS:-}"
CMP=()
for run in "${RUNS[@]}"; do
  IFS='|' read -r name envs args <<< "$run"
  env $envs timeout "${DECODE_S:-200}" python3 bench/bench_decode.py $args --json "$OUT/d_$name.json" \
    --plot "$OUT/d_$name.png" > "$OUT/d_$name.log" 2>&1
  echo "decode $name rc $?"
  CMP+=("$name=$OUT/d_$name.json")
done
if [ "${HOST:-0}" = 1 ]; then
  timeout "${HOST_S:-200}" python3 bench/bench_host.py ${HOST_ARGS:-} --markdown --json "$OUT/host.json" \
    > "$OUT/host.log" 2>&1; echo "host rc $?"
fi
run_suites
[ ${#CMP[@]} -gt 0 ] && python3 bench/dev/decode_variants_cmp.py "${CMP[@]}" > "$OUT/cmp.txt" 2>&1
[ -e "$OUT/cmp.txt" ] && tail -"${CMP_TAIL:-30}" "$OUT/cmp.txt"
for run in "${RUNS[@]}"; do
  IFS='|' read -r name envs args <<< "$run"
  echo "== d_$name.log"; tail -"${DECODE_TAIL:-14}" "$OUT/d_$name.log"
done
[ -e "$OUT/host.log" ] && { echo "== host.log"; tail -"${HOST_TAIL:-20}" "$OUT/host.log"; }
show_tests
(cd "$OUT" && tar czf /tmp/s33_all.tgz . && find . -type f ! -name cmp.txt -delete && mv /tmp/s33_all.tgz all.tgz)
exit 0
