# Steps shared by the session call scripts bench/dev/s40_call.sh and s41_call.sh. run_steps prints the
# tree's commit and the md5 of the files the forward's plans and kernels come from, then runs each step
# of STEPS (default suite): the script's own session_step STEP if it defines one and knows the step,
# else common_step STEP (its log to $OUT/${N}_<step>*.log, a summary printed). Needs OUT, N (the call's
# name) and OLD (the tree an A/B compares against); source it after call_env.sh.
#   suite    the quick GPU suite (each run numbered: ${N}_suite_runK.log)
#   slow     the slow GPU grid (-m "gpu and slow")
#   wstests  the warp-specialized / TMA forwards' GPU tests and the causal block-order tests
#   splitab  the split tail (cuflash/_schedule.py split_schedule) against none, in one process
#   threeab  OLD, this tree without the split (CUFLASH_FWD_SPLIT=0), this tree
#   splittest  the split kernels' GPU tests
#   probe    bench/dev/tail_probe.py: the non-causal forward's last wave of work tiles
#   ab       this tree against OLD in one process (HDS, SEQS, ROUNDS as fwd_ab_inproc.py reads them)
#   grid     bench.py's full grid with the peers and plots
#   bgrid    bench.py's backward over FlashAttention-2's grid with SDPA flash and cuDNN (G_ROUNDS, default
#            4; G_HDS, default 64 128)
#   dgrid    bench_decode.py's full grid with the peers (DGRID_ENV: environment for it)
#   dtests   the decode GPU test files
#   layout   tests/test_gpu_layout.py (the Params layout probes; -rs)
#   dab      decode_splits.py at the library's plans (contiguous and 16-row pages), OLD's tree and this
#            one alternately (old new old new), each in its own process on the same card (DAB_SHAPES,
#            DAB_SPLITS; OLD made with git archive HEAD cuflash cuda_src bench/dev/decode_splits.py)
#   speers   bench/dev/decode_split_peers.py: forced split counts against the library's plan and cuDNN in the
#            same rounds, at SP_SHAPES (BxLxG) and SP_SPLITS, with the library's plan made under each of
#            SP_SETTINGS (NAME:VAR=VAL,...), SP_ROUNDS rounds (default 9)
#   tl       bench/dev/decode_timeline.py on this tree (TL_SHAPES, --paged, TL_SPLITS, TL_MODES, TL_REPS, TL_ARGS)
#   envab    decode_splits.py at the library's plans (contiguous and 16-row pages) with ENVAB_VAR set to
#            each of ENVAB_VALUES in turn ("lib": unset), twice, each in its own process (ENVAB_SHAPES)
#   psplit   decode_splits.py on this tree at forced split counts (PS_SPLITS) and warps (PS_WARPS),
#            contiguous and 16-row pages (PS_SHAPES)
#   host     bench/bench_host.py on HOST_ROWS (host time per call against SDPA flash and cuDNN)
#   newcache the kernel cache entries this call compiled (newer than T0, made when this file is
#            sourced: the carried cache unpacks with its archived times), as ${N}_newcache.tgz, to
#            merge into the carried cache there
T0="${T0:-$(mktemp)}"
# pytest_step NAME ARGS...: pytest -q -rfs ARGS into $OUT/${N}_NAME.log; prints its failures, errors,
# skips and seeds, then its summary line.
pytest_step() {
  local name=$1
  shift
  python3 -m pytest -q -rfs -p no:cacheprovider "$@" > "$OUT/${N}_$name.log" 2>&1
  grep -E "^FAILED|^ERROR|^SKIPPED|seed" "$OUT/${N}_$name.log" | head -20
  echo "$name: $(tail -n 1 "$OUT/${N}_$name.log")"
}
common_step() {
  case "$1" in
    suite)
      K=$((K + 1))
      python3 -m pytest -m "gpu and not slow" -q -rf -n 8 -p no:cacheprovider tests > "$OUT/${N}_suite_run$K.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_suite_run$K.log" | head -20
      echo "suite run $K: $(tail -n 1 "$OUT/${N}_suite_run$K.log")" ;;
    slow)
      python3 -m pytest -m "gpu and slow" -q -rf -n 8 -p no:cacheprovider tests > "$OUT/${N}_slow.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_slow.log" | head -20
      echo "slow: $(tail -n 1 "$OUT/${N}_slow.log")" ;;
    wstests)
      python3 -m pytest -q -rf -n 8 -p no:cacheprovider tests/test_fwd_ws_gpu.py tests/test_block_order_gpu.py \
        tests/test_fwd_tma_gpu.py > "$OUT/${N}_wstests.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_wstests.log" | head -20
      echo "wstests: $(tail -n 1 "$OUT/${N}_wstests.log")" ;;
    splitab)  # the split tail against none (CUFLASH_FWD_SPLIT=0), same process, head_dim 128
      HDS="${HDS:-128}" SEQS="${SEQS:-512 1024 2048 4096 8192 16384}" TREES="nosplit=. split=." \
        TREE_ENV="nosplit:CUFLASH_FWD_SPLIT=0" ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py \
        > "$OUT/${N}_splitab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_splitab.log" | cut -c1-200 ;;
    threeab)  # HEAD's kernels (OLD), this tree without the split (CUFLASH_FWD_SPLIT=0), this tree
      HDS="${HDS:-128}" SEQS="${SEQS:-512 1024 2048 4096 8192 16384}" \
        TREES="old=$OLD nosplit=. new=." TREE_ENV="nosplit:CUFLASH_FWD_SPLIT=0" \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_threeab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_threeab.log" | cut -c1-220 ;;
    splittest)
      python3 -m pytest -q -rf -p no:cacheprovider tests/test_fwd_ws_gpu.py -k split > "$OUT/${N}_splittest.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_splittest.log" | head -20
      echo "splittest: $(tail -n 1 "$OUT/${N}_splittest.log")" ;;
    probe)
      python3 bench/dev/tail_probe.py > "$OUT/${N}_probe.log" 2>&1; cat "$OUT/${N}_probe.log" | tail -8 ;;
    ab)
      HDS="${HDS:-128}" SEQS="${SEQS:-512 1024 2048 4096 8192 16384}" TREES="old=$OLD new=." \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_ab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_ab.log" | cut -c1-200 ;;
    grid)
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing --json "$OUT/${N}_grid.json" \
        --plots "$OUT/${N}_plots" > "$OUT/${N}_grid.log" 2>&1
      sed -n '/^cuflash \/ SDPA flash (TFLOP/,/^cuflash errors/p' "$OUT/${N}_grid.log" ;;
    bgrid)
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --passes bwd --rounds "${G_ROUNDS:-4}" \
        --head-dims ${G_HDS:-64 128} --no-compile-timing --json "$OUT/${N}_bgrid.json" > "$OUT/${N}_bgrid.log" 2>&1
      grep -E "^bwd |seqlen>=|^cuflash errors|eager" "$OUT/${N}_bgrid.log" | cut -c1-150 | tail -n 40 ;;
    dgrid)
      env ${DGRID_ENV:-} python3 bench/bench_decode.py --json "$OUT/${N}_dgrid.json" --plot "$OUT/${N}_dgrid.png" \
        > "$OUT/${N}_dgrid.log" 2>&1
      tail -n 30 "$OUT/${N}_dgrid.log" ;;
    layout)
      pytest_step layout tests/test_gpu_layout.py ;;
    dtests)
      python3 -m pytest -m gpu -q -rf -n 8 -p no:cacheprovider tests/test_kvcache_device.py \
        tests/test_kvcache_decode.py > "$OUT/${N}_dtests.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_dtests.log" | head -20
      echo "dtests: $(tail -n 1 "$OUT/${N}_dtests.log")" ;;
    dab)
      DABK=0
      for t in old new old new; do
        DABK=$((DABK + 1))
        if [ "$t" = old ]; then root="$OLD"; else root=.; fi
        PYTHONPATH="$root" python3 "$root/bench/dev/decode_splits.py" --paged --splits ${DAB_SPLITS:-0} \
          --calls "${CALLS:-30}" --rounds "${ROUNDS:-9}" --json "$OUT/${N}_dab_$t$DABK.json" \
          --shapes ${DAB_SHAPES:-4x512x1 16x512x4 1x512x1 16x2048x8 1x8192x1 4x32768x4 16x8192x8} \
          > "$OUT/${N}_dab_$t$DABK.log" 2>&1
        echo "dab $t$DABK: $(grep -c ' us ' "$OUT/${N}_dab_$t$DABK.log") rows"
      done ;;
    speers)
      python3 bench/dev/decode_split_peers.py --shapes ${SP_SHAPES:-16x131072x4 4x8192x1 64x131072x8} \
        --splits ${SP_SPLITS:-2 4 8 16 32} --settings ${SP_SETTINGS:-} --rounds "${SP_ROUNDS:-9}" --json "$OUT/${N}_speers.json" \
        > "$OUT/${N}_speers.log" 2>&1
      grep -E "^==| us |Error|error" "$OUT/${N}_speers.log" | cut -c1-200 ;;
    envab)
      for pass_ in 1 2; do
        for val in ${ENVAB_VALUES:-0 lib}; do
          if [ "$val" = lib ]; then pre="env -u $ENVAB_VAR"; else pre="env $ENVAB_VAR=$val"; fi
          $pre python3 bench/dev/decode_splits.py --paged --splits 0 --calls "${CALLS:-30}" --rounds "${ROUNDS:-9}" \
            --json "$OUT/${N}_envab_$val$pass_.json" --shapes ${ENVAB_SHAPES:-64x131072x8 64x2048x8} \
            > "$OUT/${N}_envab_$val$pass_.log" 2>&1
          echo "envab $ENVAB_VAR=$val ($pass_): $(grep -c ' us ' "$OUT/${N}_envab_$val$pass_.log") rows"
        done
      done ;;
    tl)
      python3 bench/dev/decode_timeline.py --paged --reps "${TL_REPS:-10}" --modes ${TL_MODES:-idle graph} \
        --splits "${TL_SPLITS:-0}" ${TL_ARGS:-} --shapes ${TL_SHAPES:-16x2048x8 16x512x4} --json "$OUT/${N}_tl.json" \
        > "$OUT/${N}_tl.log" 2>&1
      echo "tl: $(grep -c span "$OUT/${N}_tl.log") rows" ;;
    psplit)
      python3 bench/dev/decode_splits.py --paged --splits ${PS_SPLITS:-0 1 2 4} --warps ${PS_WARPS:-0 4 8} \
        --calls "${CALLS:-30}" --rounds "${ROUNDS:-7}" --json "$OUT/${N}_psplit.json" \
        --shapes ${PS_SHAPES:-16x2048x8 16x2048x4 16x512x4 4x512x1 16x512x8} > "$OUT/${N}_psplit.log" 2>&1
      echo "psplit: $(grep -c ' us ' "$OUT/${N}_psplit.log") rows"; tail -n 2 "$OUT/${N}_psplit.log" ;;
    host)
      python3 bench/bench_host.py --rounds "${HOST_ROUNDS:-9}" --json "$OUT/${N}_host.json" \
        --rows ${HOST_ROWS:-torch.fwd torch.fwd_grad torch.fwdbwd sdpa_flash.* sdpa_cudnn.* cupy.fwd} \
        > "$OUT/${N}_host.log" 2>&1
      tail -n 14 "$OUT/${N}_host.log" ;;
    newcache)
      (cd .cache && find cf -type f -newer "$T0" > "$T0.list" && tar czf "$OUT/${N}_newcache.tgz" -T "$T0.list")
      echo "newcache: $(wc -l < "$T0.list") files, $(du -h "$OUT/${N}_newcache.tgz" | cut -f1)" ;;
    *) return 1 ;;
  esac
}

run_steps() {
  git rev-parse --short HEAD 2>/dev/null
  md5sum cuflash/_config.py cuflash/_launch.py cuflash/_schedule.py cuda_src/flash_fwd_sm90_ws.cu | cut -c1-12
  K=0
  local step
  for step in ${STEPS:-suite}; do
    if declare -F session_step > /dev/null && session_step "$step"; then continue; fi
    common_step "$step" || echo "unknown step $step"
  done
}

archive_logs() {  # the logs and JSON this call wrote, as $OUT/${N}_logs$1.tgz, and the clean-up after it
  # (whichever exist: a glob without a match would fail tar; newcache's archive is kept as it is)
  (cd "$OUT" && tar czf "${N}_logs${1:-}.tgz" $(ls ${N}_*.log ${N}_*.json 2>/dev/null) && find . -maxdepth 1 \
    -name "${N}_*" ! -name "${N}_logs*.tgz" ! -name "${N}_newcache.tgz" -delete)
}
