"""Dev: the loops of a kernel's SASS (nvdisasm -c output) that issue wgmma, each with its instruction
count and most frequent opcodes. A loop is a backward branch's span. Session 39 used it to find the
persistent causal forward's mask-free loop at 620 instructions (48 R2UR) against 572.

SASS on the build machine: NVRTC's PTX (-arch=compute_90a, cuflash/_compile.py base_options), then
ptxas -arch=sm_90a and nvdisasm -c (the nvidia-cuda-nvdisasm wheel).
Usage: python bench/dev/sass_loops.py KERNEL.sass [...]"""
import re
import sys
from collections import Counter

for f in sys.argv[1:]:
    labels, instrs = {}, []
    for line in open(f).read().splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(2))
    print(f)
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            body = instrs[labels[m.group(1)]:i + 1]
            if any("HGMMA" in x for x in body):
                ops = Counter(x.split()[1] if x.startswith("@") else x.split()[0] for x in body)
                print(f"  loop {labels[m.group(1)]}-{i}: {len(body)} instructions, "
                      f"{sum('HGMMA' in x for x in body)} HGMMA; {ops.most_common(10)}")
