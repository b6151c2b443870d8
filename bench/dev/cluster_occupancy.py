#!/usr/bin/env python3
"""The most clusters of the decode kernel resident at once (cuOccupancyMaxActiveClusters through
cuflash/_launch.py _max_active_clusters), per kernel (4-warp TMA 3 stages, 4-warp TMA 4 stages, 8-warp
TMA; head_dim 128, bf16) and cluster size 2 / 4 / 8 / 16, with the blocks that makes (clusters x
size) beside the SM count. Usage: python bench/dev/cluster_occupancy.py"""
import cupy

from cuflash import _compile, _config, _launch

dev = cupy.cuda.Device()
sms = dev.attributes["MultiProcessorCount"]
print(cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), "SMs", sms)
for stages, warps in ((3, 4), (4, 4), (2, 8)):
    spec, smem = _launch.decode_specialization("bfloat16", 128, stages, warps, True)
    fn = _compile.get_function(spec, "sm_90a", dev.id, smem)
    row = []
    for c in (2, 4, 8, 16):
        n = _launch._max_active_clusters(fn.ptr, c * 16, 32 * warps, smem, c)
        row.append(f"cluster {c:2d}: {n:3d} clusters = {n * c:3d} blocks")
    print(f"{spec.name:28s} smem {smem:6d}  " + "; ".join(row), flush=True)
