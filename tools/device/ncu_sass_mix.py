"""Warp-instructions and stall samples by SASS opcode from Nsight Compute source pages
(`ncu -i REP --page source --print-source sass --csv`, e.g. the `*_src.csv` of
tools/device/ncu_w4a16_fused.sh or ncu_attention.sh): what a kernel spends its issue slots on.

    python3 tools/device/ncu_sass_mix.py [--top 22] FILE.csv[.gz] ...
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys


def mix(path: str) -> tuple[str, collections.Counter, collections.Counter]:
    """(kernel name, warp-instructions by opcode, stall samples by opcode) of one source page."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    name = rows[0][1] if rows and len(rows[0]) > 1 else "?"
    hdr = next(i for i, r in enumerate(rows) if "Instructions Executed" in r)
    cols = rows[hdr]
    ie, src, smp = (cols.index(c) for c in ("Instructions Executed", "Source", "Warp Stall Sampling (All Samples)"))
    inst, samples = collections.Counter(), collections.Counter()
    for r in rows[hdr + 1:]:
        if len(r) <= max(ie, src, smp):
            continue
        toks = r[src].split()
        if not toks:
            continue
        op = toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]  # predicate first
        try:
            inst[op.split(".")[0]] += int(r[ie].replace(",", ""))
            samples[op.split(".")[0]] += int(r[smp].replace(",", ""))
        except ValueError:
            continue
    return name, inst, samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args(argv)
    for path in args.files:
        try:
            name, inst, samples = mix(path)
        except (OSError, StopIteration, ValueError) as e:
            print(f"== {path}: not an ncu source page ({type(e).__name__}: {e})")
            continue
        n, s = sum(inst.values()), sum(samples.values())
        print(f"== {path}: {name}: {n} warp-instructions, {s} stall samples")
        for op, c in inst.most_common(args.top):
            print(f"  {op:10s} {c:11d} {100 * c / max(n, 1):5.1f}%   samples {100 * samples[op] / max(s, 1):5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
