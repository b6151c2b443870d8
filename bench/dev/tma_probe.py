#!/usr/bin/env python3
"""TMA plumbing on a Hopper GPU (docs/hopper_plan.md step 1): the host cost of a tensor map, and one
probe load checked against the SW128 layout.

Prints: the median µs of cuflash._tma.kv_map (one cuTensorMapEncodeTiled through ctypes) over
--encodes calls with fresh pointers, of a MapCache hit, and of one probe launch's host side; then
whether a head_dim-128 tile loaded by cuda_src/tma_probe.cu equals _tma.expected_tile (the full
check is tests/test_tma_gpu.py). The hot-path rule of the plan: if an encode costs a few µs, a plan
pays it only when a pointer is new (MapCache).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encodes", type=int, default=2000)
    args = ap.parse_args()

    import torch

    from cuflash import _compile, _config, _launch, _tma

    dev = 0
    x = torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)
    shape, strides = tuple(x.shape), tuple(x.stride())
    base = x.data_ptr()

    # Encode cost: distinct (16-byte aligned) pointers inside x, so that nothing is cached anywhere.
    _tma.kv_map(base, shape, strides, 128, "bfloat16")  # loads libcuda
    times = []
    for i in range(args.encodes):
        t0 = time.perf_counter_ns()
        _tma.kv_map(base + 16 * (i % 1024), shape, strides, 128, "bfloat16")
        times.append(time.perf_counter_ns() - t0)
    enc = statistics.median(times) / 1e3

    # The one-word patch (cuflash/_tma.py learn_patch): learned? equal to the driver's maps at real
    # pointers? Which words change between two pointers (for a driver where it is not learned)?
    patch = _tma.layout_patch(shape, strides, 128, "bfloat16")
    m0 = np.frombuffer(_tma.kv_map(base, shape, strides, 128, "bfloat16"), np.uint64)
    m1 = np.frombuffer(_tma.kv_map(base + 0x123450, shape, strides, 128, "bfloat16"), np.uint64)
    changed = [(int(i), hex(int(m0[i])), hex(int(m1[i]))) for i in np.nonzero(m0 != m1)[0]]
    patch_ok, patch_us = None, None
    if patch is not None:
        ptrs = [base + 16 * i for i in range(0, 1 << 20, 997)]
        patch_ok = all(patch.map(p_) == _tma.kv_map(p_, shape, strides, 128, "bfloat16") for p_ in ptrs)
        t = []
        for i in range(args.encodes):
            t0 = time.perf_counter_ns()
            patch.word_value(base + 16 * i)
            t.append(time.perf_counter_ns() - t0)
        patch_us = statistics.median(t) / 1e3

    cache = _tma.MapCache(shape, strides, 128, "bfloat16")
    cache.get(base)
    hits = []
    for _ in range(args.encodes):
        t0 = time.perf_counter_ns()
        cache.get(base)
        hits.append(time.perf_counter_ns() - t0)
    hit = statistics.median(hits) / 1e3

    # One probe: tile rows [4000, 4128) of (head 5, batch 3), the last 32 rows past the end.
    target = _config.compile_arch(*torch.cuda.get_device_capability(dev))
    spec, smem = _tma.probe_specialization(128, 2), _tma.probe_smem_bytes(128, 2)
    t0 = time.perf_counter()
    fn = _compile.get_function(spec, target, dev, smem)
    compile_s = time.perf_counter() - t0
    out = torch.empty((1, 128 * 2 * 128), dtype=torch.uint8, device="cuda")
    p = np.zeros((), dtype=_tma.PROBE_PARAMS)
    p["map"] = np.frombuffer(cache.get(base), np.uint8)
    p["row0"], p["head"], p["batch"] = 4000, 5, 3
    launch = _launch.Launch(spec.name, fn.ptr, 1, 128, smem, p, {"out": out.data_ptr()}, dev)
    stream = torch.cuda.current_stream().cuda_stream
    fire = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        launch.fire(stream, ())
        fire.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    host = x.cpu().view(torch.int16).numpy().view(np.uint16)
    ok = np.array_equal(out.cpu().numpy()[0], _tma.expected_tile(host, 4000, 128, 5, 3))

    print(f"device: {torch.cuda.get_device_name()}")
    print(f"kv_map encode (cuTensorMapEncodeTiled via ctypes): {enc:.2f} us median over {args.encodes}")
    print(f"MapCache hit: {hit:.3f} us; probe launch (host side): {statistics.median(fire) / 1e3:.2f} us")
    print(f"probe compile or cache load: {compile_s:.2f} s")
    print(f"words that differ between the maps of two pointers: {changed}")
    if patch is None:
        print("one-word patch: NOT learned (each new pointer costs an encode)")
    else:
        print(f"one-word patch: learned (word {patch.word}, shift {patch.shift}, const {patch.const:#x}); "
              f"equal to the driver at {len(ptrs)} real pointers: {'yes' if patch_ok else 'NO'}; "
              f"{patch_us:.3f} us per word")
    print(f"probe tile equals the SW128 reference: {'yes' if ok else 'NO'}")
    if not ok or patch_ok is False:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
