#!/usr/bin/env python3
"""Static counts of the fused attention kernels' sm_90 machine code, for work without a GPU.

Compiles kernels/flash_attention.cu to an sm_90 cubin with nvcc and, for every kernel, prints
its SASS instruction count (each instruction is 16 bytes of its .text section), its registers
and spill bytes (from ptxas -v), its tensor-core instructions (HMMA) and its local-memory
accesses (STL/LDL: spills), split into those between the first and last HMMA (the tile loop's
body, which every kernel holds once) and the rest (set-up and epilogue).

No disassembler is needed. The opcodes are the low 12 bits of each instruction, identified by
compiling one-instruction kernels with CUDA 13: HMMA 0x23c, STL 0x387, LDL 0x983. Another
CUDA version may encode them differently; the script then finds no HMMA and says so.

  python3 tests/bench/sass_stats.py [--nvcc /usr/local/cuda/bin/nvcc] [--filter bf16]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

HMMA, STL, LDL = 0x23C, 0x387, 0x983
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def demangle(name):
    out = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
    out = out.replace("shardtrain::kernels::(anonymous namespace)::", "").replace("void ", "")
    # The dtype names the kernel bench and docs use (and --filter bf16 matches).
    out = out.replace("__nv_bfloat16", "bf16").replace("__half", "f16")
    return re.sub(r"\(.*", "", out)


def text_sections(cubin):
    listing = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True,
                             text=True).stdout
    data = open(cubin, "rb").read()
    for line in listing.splitlines():
        m = re.search(r"\.text\.(\S+)\s+PROGBITS\s+\S+\s+(\S+)\s+(\S+)", line)
        if m:
            off, size = int(m.group(2), 16), int(m.group(3), 16)
            yield m.group(1), data[off:off + size]


def ptxas_usage(log):
    usage, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            usage.setdefault(current, {})["spill"] = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            usage.setdefault(current, {})["registers"] = int(m.group(1))
    return usage


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvcc", default="/usr/local/cuda/bin/nvcc")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "flash_attention.cubin")
        cmd = [args.nvcc, "-DSHARDTRAIN_HAVE_CUDA=1", f"-I{ROOT}/include", f"-I{ROOT}/kernels",
               "-O3", "-DNDEBUG", "-arch=sm_90", "-cubin", "-std=c++20", "-Xptxas", "-v",
               f"{ROOT}/kernels/flash_attention.cu", "-o", cubin]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stderr, file=sys.stderr)
            return 2
        usage = ptxas_usage(run.stderr)
        print(f"{'instructions':>12} {'registers':>9} {'spill st/ld':>11} {'HMMA':>5} "
              f"{'local in loop':>13} {'local outside':>13}  kernel")
        found_hmma = False
        for mangled, code in sorted(text_sections(cubin), key=lambda x: demangle(x[0])):
            name = demangle(mangled)
            if "flash" not in name or args.filter not in name:
                continue
            ops = [int.from_bytes(code[i:i + 8], "little") & 0xFFF for i in range(0, len(code), 16)]
            mma = [i for i, op in enumerate(ops) if op == HMMA]
            local = [i for i, op in enumerate(ops) if op in (STL, LDL)]
            found_hmma |= bool(mma)
            inside = [i for i in local if mma and mma[0] <= i <= mma[-1]]
            u = usage.get(mangled, {})
            spill = "%d/%d" % u.get("spill", (0, 0))
            print(f"{len(ops):>12} {u.get('registers', 0):>9} {spill:>11} {len(mma):>5} "
                  f"{len(inside):>13} {len(local) - len(inside):>13}  {name}")
        if not found_hmma:
            print("sass_stats: no HMMA found: this nvcc encodes opcodes differently",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
