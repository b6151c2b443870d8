"""Dev: the loops of a kernel's SASS (nvdisasm -c output) that issue a given tensor-core instruction
(HGMMA by default: wgmma; --op HMMA: mma.sync), each with its instruction count and most frequent
opcodes. A loop is a backward branch's span; counts are static (every branch of the body). Session
39 used it to find the persistent causal forward's mask-free loop at 620 instructions (48 R2UR)
against 572.

SASS on the build machine: NVRTC's PTX (-arch=compute_90a, cuflash/_compile.py base_options), then
ptxas -arch=sm_90a and nvdisasm -c (the nvidia-cuda-nvcc and nvidia-cuda-nvdisasm wheels of NVRTC's
version; bench/dev/decode_sass.py does all three for the decode kernels).
Usage: python bench/dev/sass_loops.py [--op HMMA] KERNEL.sass [...]"""
import re
import sys
from collections import Counter


def loops(path: str, op: str = "HGMMA", top: int = 10) -> list[str]:
    """One line per loop of the SASS file at path whose body issues `op`."""
    labels, instrs = {}, []
    for line in open(path).read().splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(2))
    out = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            body = instrs[labels[m.group(1)]:i + 1]
            n_op = sum(op in x for x in body)
            if n_op:
                ops = Counter(x.split()[1] if x.startswith("@") else x.split()[0] for x in body)
                out.append(f"  loop {labels[m.group(1)]}-{i}: {len(body)} instructions, {n_op} {op}; "
                           f"{ops.most_common(top)}")
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    op = "HGMMA"
    if args[:1] == ["--op"]:
        op, args = args[1], args[2:]
    for f in args:
        print(f)
        print("\n".join(loops(f, op)))
