#!/bin/bash
# Session 22, call 1: one consumer warpgroup, two blocks an SM (flash_fwd_sm90_ws.cu with CONSUMERS = 1:
# __launch_bounds__(256, 2), setmaxnreg 232; a variant measured and not kept, so `--consumers 1` is not
# in this tree's tma_tiles.py), against the table's kernels at the same lengths (back-to-back launches,
# bf16). Results: bench/results/ws_one_consumer_s22_h100.json, NOTES session 22.
set -u
S=${SEQS:-"512 1024 2048 4096 16384"}
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python bench/dev/tma_tiles.py --no-tma --ws --consumers 1 --head-dims ${HDS:-64 128} --seqlens $S \
    --ws-tiles ${C1_TILES:-128:2 128:3 64:2} > $OUT/c1.log 2>&1; cp $OUT/tma_tiles.json $OUT/c1.json
python bench/dev/tma_tiles.py --no-tma --ws --pingpong --consumers 2 --head-dims 128 --seqlens $S \
    --ws-tiles 128:2 > $OUT/d128base.log 2>&1; cp $OUT/tma_tiles.json $OUT/d128base.json
python bench/dev/tma_tiles.py --ws --consumers 3 --head-dims 64 --seqlens $S --tma-tiles 64:128 64:64 \
    --ws-tiles 128:2 128:3 > $OUT/d64base.log 2>&1; cp $OUT/tma_tiles.json $OUT/d64base.json
grep -h "device\|^ws\|^d64\|^d128\|Error\|Traceback" $OUT/c1.log $OUT/d128base.log $OUT/d64base.log
