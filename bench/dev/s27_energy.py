"""Energy per forward call, cuflash beside SDPA's cuDNN backend (session 27).

The H100's clocks step between about 1500 and 1980 MHz while attention runs (nvidia-smi: the SW
power cap is the active throttle reason), and a provider's median GPU time follows the clock it
happened to get (bench/dev/s27_dist.py). Under a power cap, sustained speed is the power limit over
the energy of one call, so this measures that energy: for each shape, the providers alternate in
WINDOWS windows of about WINDOW_S seconds of back-to-back calls; NVML's total-energy counter is read
around each window (after a synchronize), with the window's calls, its wall time and the SM clock
sampled at its end.

  SHAPES="bfloat16:128:8192:0 ..."  (dtype:head_dim:seqlen:causal; 16k tokens, hidden 2048)
  ENV_B="CUFLASH_FWD_WS=1;CUFLASH_FWD_TMA_TILE=128x64"  (optional, ";"-separated: one more cuflash
      provider per entry, cuflash_B1, B2, ..., each a copy of the package (treeload.py) with its own
      plan cache, run with the entry's variables set)
Prints mJ per call, calls per second, mean power; the ratio of medians over the windows.
"""
import ctypes
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.getcwd())
import cuflash  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from treeload import EnvSet, load  # noqa: E402

COPIES = {}

WINDOWS = int(os.environ.get("WINDOWS", "4"))
WINDOW_S = float(os.environ.get("WINDOW_S", "1.5"))
ENV_B = [[kv.split("=", 1) for kv in e.split() if "=" in kv] for e in os.environ.get("ENV_B", "").split(";") if e.strip()]
SHAPES = os.environ.get("SHAPES", "bfloat16:64:1024:0 float16:64:2048:1 bfloat16:128:2048:0 "
                                  "bfloat16:128:8192:0").split()


class Nvml:
    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0
        self.h = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h)) == 0

    def energy_mj(self):
        e = ctypes.c_ulonglong()
        rc = self.lib.nvmlDeviceGetTotalEnergyConsumption(self.h, ctypes.byref(e))
        assert rc == 0, rc
        return e.value

    def sm_clock(self):
        c = ctypes.c_uint()
        self.lib.nvmlDeviceGetClockInfo(self.h, 1, ctypes.byref(c))   # NVML_CLOCK_SM
        return c.value


def main():
    if ENV_B:   # copies of the package with plan caches of their own (plans read CUFLASH_* when made)
        for i in range(len(ENV_B)):
            COPIES[i] = load(f"cuflash_b{i + 1}", os.getcwd(), f"cuflash_b{i + 1}")
    nv = Nvml()
    print(torch.cuda.get_device_name(), "WINDOWS", WINDOWS, "WINDOW_S", WINDOW_S)
    for sh in SHAPES:
        dt, hd, s, c = sh.split(":")
        dt, hd, s, c = getattr(torch, dt), int(hd), int(s), c == "1"
        h, b = 2048 // hd, 16384 // s
        q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        provs = {"cuflash": (lambda: cuflash.attention(q, k, v, causal=c), None),
                 "cudnn": (lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                  v.transpose(1, 2), is_causal=c),
                           SDPBackend.CUDNN_ATTENTION)}
        for i, env in enumerate(ENV_B):
            provs[f"cuflash_B{i + 1}"] = ((lambda m: lambda: m.attention(q, k, v, causal=c))(COPIES[i]), env)
        per = {}
        for name, (fn, be) in list(provs.items()):
            try:
                with _ctx(be):
                    fn()
                    torch.cuda.synchronize()
            except Exception as e:   # a variant that does not build or run: left out, said why
                print(f"{sh} {name}: {type(e).__name__}: {str(e)[:200]}")
                del provs[name]
                continue
            with _ctx(be):
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                per[name] = (time.perf_counter() - t0) / 20
        rows = {n: [] for n in provs}
        for w in range(WINDOWS):
            for name, (fn, be) in provs.items():
                n = max(10, int(WINDOW_S / per[name]))
                with _ctx(be):
                    torch.cuda.synchronize()
                    e0, t0 = nv.energy_mj(), time.perf_counter()
                    for _ in range(n):
                        fn()
                    torch.cuda.synchronize()
                    e1, t1 = nv.energy_mj(), time.perf_counter()
                    clk = nv.sm_clock()
                rows[name].append(((e1 - e0) / n, (t1 - t0) / n * 1e6, (e1 - e0) / 1e3 / (t1 - t0), clk))
        print(f"\n== {sh} (b{b} h{h})")
        for name, r in rows.items():
            print(f"{name:8s} " + "  ".join(f"[{mj:6.1f} mJ {us:7.1f} us {w:4.0f} W {clk} MHz]" for mj, us, w, clk in r))
        med = {n: (statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)) for n, r in rows.items()}
        for n in med:
            if n != "cudnn":
                print("%s / cudnn: energy per call %.3f, wall time per call %.3f" % (
                    n, med[n][0] / med["cudnn"][0], med[n][1] / med["cudnn"][1]))
        del q, k, v
        torch.cuda.empty_cache()


def _ctx(be):
    if isinstance(be, SDPBackend):
        return sdpa_kernel(be)
    return EnvSet(be if isinstance(be, list) else [])


if __name__ == "__main__":
    main()
