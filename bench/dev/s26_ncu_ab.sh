#!/usr/bin/env bash
# Session 26: kernel durations of two trees under Nsight Compute with the clocks locked at base
# (--clock-control base: no boost, no power throttling), one cuflash forward (and SDPA cuDNN's) of
# bench/dev/ncu_fwd.py per shape ("seqlen:head_dim:causal[:persistent]", SHAPES) and tree (TREES:
# paths, each run with PYTHONPATH at it). Carry: .cache, .oldtree.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf
OUT="${OUT:-./out}"; mkdir -p "$OUT"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)"
for shape in ${SHAPES:-16384:128:1 4096:256:0}; do
  IFS=: read -r s d c pers <<< "$shape"
  for tree in ${TREES:-.oldtree/head .}; do
    if [ -n "$pers" ]; then export CUFLASH_FWD_WS_PERSISTENT=$pers; else unset CUFLASH_FWD_WS_PERSISTENT; fi
    PYTHONPATH=$tree timeout 120 "$NCU" --profile-from-start off --clock-control base --section SpeedOfLight --csv \
      --page details python3 bench/dev/ncu_fwd.py "$s" "$d" "$c" > /tmp/ncu_ab.csv 2>/dev/null
    python3 - "$shape" "$tree" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader([l for l in open("/tmp/ncu_ab.csv") if l.startswith('"')])]
out = []
for r in rows:
    if r["Metric Name"] == "Duration":
        k = r["Kernel Name"]
        out.append(("cudnn" if "cudnn" in k else k.split("<")[0].split("::")[-1] + "<" + k.split("<", 1)[1][:60]) + f" {r['Metric Value']} {r['Metric Unit']}")
print(f"{sys.argv[1]:16s} {sys.argv[2]:14s} " + " | ".join(out))
PY
  done
done
unset CUFLASH_FWD_WS_PERSISTENT
exit 0
