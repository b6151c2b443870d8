#!/usr/bin/env bash
# Session 59's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, host, psplit, newcache, ...).
#   d64v    head_dim 64 causal forward, the table's kernel against variants reachable by environment, all in
#           one process (bench/dev/fwd_ab_inproc.py; V_SEQS, default 2048; ROUNDS): the TMA variant's causal
#           tail of one wave off (CUFLASH_FWD_TAIL_BLOCKS=0) and of two waves, its 64 x 128 and 128 x 64
#           tiles, the warp-specialized kernel on three and on two consumers, and on the persistent grid
#           (two consumers, work lists)
#   d64w    the TMA variant's causal tail of 2, 3 and 4 waves, its 64 x 128 tiles, and both together, at 1k and
#           2k keys (W_TREES and W_ENV replace the trees and their environments, W_HDS the head dims)
#   d64c    bench.py at head_dim 64, causal, forward, cuflash against cuDNN (D64_SEQS, D64_ROUNDS; D64_ENV:
#           environment for the run, e.g. a variant of d64v; D64_TAG: a suffix of its log's name)
#   d64grid bench.py's forward grid at head_dim 64 with SDPA flash and cuDNN (G_ROUNDS rounds, default 4)
#   STEPS="d64v d64c" CALL=c1 bash bench/dev/s59_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main59}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    d64v)
      HDS=64 SEQS="${V_SEQS:-2048}" TREES="table=. tail0=. tail2=. t64x128=. t128x64=. ws3=. ws2=. pers2=." \
        TREE_ENV="tail0:CUFLASH_FWD_TAIL_BLOCKS=0 tail2:CUFLASH_FWD_TAIL_WAVES=2 t64x128:CUFLASH_FWD_TMA_TILE=64x128 t128x64:CUFLASH_FWD_TMA_TILE=128x64 ws3:CUFLASH_FWD_WS=1 ws2:CUFLASH_FWD_WS=1,CUFLASH_FWD_WS_CONSUMERS=2 pers2:CUFLASH_FWD_WS=1,CUFLASH_FWD_WS_PERSISTENT=1" \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_d64v.log" 2>&1
      grep -vE "^[0-9a-z_]+ from" "$OUT/${N}_d64v.log" | cut -c1-260 | tail -n 40 ;;
    d64w)  # the TMA variant's causal tail waves and 64 x 128 tiles, alone and together (W_TREES, W_ENV)
      HDS="${W_HDS:-64}" SEQS="${V_SEQS:-1024 2048}" TREES="${W_TREES:-table=. tail2=. tail3=. tail4=. n128=. n128t2=. n128t3=.}" \
        TREE_ENV="${W_ENV:-tail2:CUFLASH_FWD_TAIL_WAVES=2 tail3:CUFLASH_FWD_TAIL_WAVES=3 tail4:CUFLASH_FWD_TAIL_WAVES=4 n128:CUFLASH_FWD_TMA_TILE=64x128 n128t2:CUFLASH_FWD_TMA_TILE=64x128,CUFLASH_FWD_TAIL_WAVES=2 n128t3:CUFLASH_FWD_TMA_TILE=64x128,CUFLASH_FWD_TAIL_WAVES=3}" \
        DTYPES="bfloat16 float16" ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_d64w.log" 2>&1
      grep -vE "^[0-9a-z_]+ from" "$OUT/${N}_d64w.log" | grep -E "causal=1|geomean|rror" | cut -c1-300 | tail -n 40 ;;
    d64c)
      env ${D64_ENV:-} python3 bench/bench.py --providers cuflash sdpa_cudnn --head-dims 64 --seqlens ${D64_SEQS:-2048} \
        --causal on --passes fwd --rounds "${D64_ROUNDS:-12}" --no-compile-timing \
        --json "$OUT/${N}_d64c${D64_TAG:-}.json" > "$OUT/${N}_d64c${D64_TAG:-}.log" 2>&1
      grep -E "^fwd " "$OUT/${N}_d64c${D64_TAG:-}.log" | tail -n 4 ;;
    d64grid)  # bench.py's forward at head_dim 64 against SDPA flash and cuDNN (FlashAttention-2's grid)
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --head-dims 64 --passes fwd \
        --rounds "${G_ROUNDS:-4}" --no-compile-timing --json "$OUT/${N}_d64grid.json" > "$OUT/${N}_d64grid.log" 2>&1
      grep -E "^fwd |seqlen>=|^cuflash errors" "$OUT/${N}_d64grid.log" | cut -c1-130 | head -n 40 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
