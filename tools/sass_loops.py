"""The loops of a SASS listing and the instruction mix of each (how a kernel's block loop was counted).

    python3 tools/sass_loops.py KERNEL.sass [--min 150]

KERNEL.sass: `cuobjdump -sass` output (what `tools/device/mgpu_dump.py` copies out). A loop is the range from a
backward branch's target to the branch; every loop with an HGMMA, or of at least --min instructions, is printed
with its length, its HGMMA count and its opcodes by count (predicates and modifiers dropped). Nested loops are
printed each on its own, so an outer loop's counts include its inner ones. Needs no GPU.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def instructions(text: str) -> list[tuple[int, str]]:
    """(address, instruction text) for every SASS instruction line."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each backward branch's range."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            out.append((index[int(m.group(1), 16)], i))
    return out


def opcode(t: str) -> str:
    """The opcode without its predicate and modifiers: '@!P0 LOP3.LUT R1, ...' -> 'LOP3'."""
    return re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sass")
    ap.add_argument("--min", type=int, default=150, help="print loops without HGMMA from this many instructions")
    args = ap.parse_args(argv)
    with open(args.sass) as f:
        ins = instructions(f.read())
    for s, e in loops(ins):
        ops = [opcode(t) for _, t in ins[s:e + 1]]
        n_mma = ops.count("HGMMA")
        if n_mma == 0 and len(ops) < args.min:
            continue
        mix = collections.Counter(ops)
        print(f"loop [{ins[s][0]:#x}, {ins[e][0]:#x}] {len(ops)} instr, HGMMA {n_mma}")
        print("    " + ", ".join(f"{k} {v}" for k, v in mix.most_common(30)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
