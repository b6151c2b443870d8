#!/usr/bin/env bash
# Session 52's device calls: this session's step below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, host, ...).
#   d64c   bench.py at issue 12's closest forward point (head_dim 64, causal, 4k keys, both dtypes) against
#          cuDNN, D64C_ROUNDS (16) rounds, once per forward configuration in D64C_VARIANTS (each its own
#          process, in turn twice): default (the table), s3 (CUFLASH_FWD_WS_STAGES=3), c2
#          (CUFLASH_FWD_WS_CONSUMERS=2), tma (CUFLASH_FWD_WS=0: the TMA variant)
#   specab (branch s52-spec-table) decode_splits.py at the library's plans, contiguous and 16-row pages, on OLD's
#          tree, this tree, and this tree with CUFLASH_DECODE_SPEC_TABLE=1 (the first table entries read
#          before pdl_wait: a measurement only), in turn twice, each its own process (SA_SHAPES); the
#          carried .cache/cf52.txz holds this tree's decode kernels
#   STEPS="suite d64c" CALL=c1 bash bench/dev/s52_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main52}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
variant_env() {
  case "$1" in
    default) echo "CUFLASH_NONE=1" ;;
    s3) echo "CUFLASH_FWD_WS_STAGES=3" ;;
    c2) echo "CUFLASH_FWD_WS_CONSUMERS=2" ;;
    tma) echo "CUFLASH_FWD_WS=0" ;;
  esac
}
session_step() {
  case "$1" in
    d64c)
      for pass in 1 2; do
        for var in ${D64C_VARIANTS:-default s3 c2 tma}; do
          env $(variant_env "$var") python3 bench/bench.py --providers cuflash sdpa_cudnn --head-dims 64 \
            --seqlens ${D64C_SEQS:-4096} --causal on --passes fwd --rounds "${D64C_ROUNDS:-16}" --no-compile-timing \
            --json "$OUT/${N}_d64c_${var}_$pass.json" > "$OUT/${N}_d64c_${var}_$pass.log" 2>&1
          echo "== $var pass $pass"; grep -E "^\[" "$OUT/${N}_d64c_${var}_$pass.log" | cut -c1-220
        done
      done ;;
    specab)
      [ -f .cache/cf52.txz ] && tar -C .cache -xJf .cache/cf52.txz
      k=0
      for pass in 1 2; do
        for var in old br spec; do
          k=$((k + 1)); root=.; envs="CUFLASH_NONE=1"
          [ "$var" = old ] && root="$OLD"
          [ "$var" = spec ] && envs="CUFLASH_DECODE_SPEC_TABLE=1"
          env $envs PYTHONPATH="$root" python3 "$root/bench/dev/decode_splits.py" --paged --splits 0 --calls 50 \
            --rounds 7 --shapes ${SA_SHAPES:-4x512x1 16x512x4 16x512x8 16x2048x8 1x512x1} \
            --json "$OUT/${N}_specab_${k}_$var.json" > "$OUT/${N}_specab_${k}_$var.log" 2>&1
          echo "== run $k ($var)"; grep " us " "$OUT/${N}_specab_${k}_$var.log" | cut -c1-150
        done
      done ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" ! -name "${N}_newcache.tgz" ! -name "${N}_grid.json" ! -name "${N}_plots" ! -name "${N}_host.json" -delete)
