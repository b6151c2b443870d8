export PYTHONPATH=. CUFLASH_CACHE_DIR=$PWD/.cache/cf
SH="1x32768x1 16x32768x8 4x32768x1 16x8192x4 64x32768x8"
python3 bench/dev/paged_locality.py --pages 16 --shapes $SH 2>&1 | tail -6
echo "== WARPS=8"; CUFLASH_DECODE_WARPS=8 python3 bench/dev/paged_locality.py --pages 16 64 --shapes $SH 2>&1 | tail -11
echo "== DEEP=1"; CUFLASH_DECODE_DEEP=1 python3 bench/dev/paged_locality.py --pages 16 --shapes $SH 2>&1 | tail -6
