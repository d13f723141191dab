"""Warp-instructions and stall samples by SASS opcode from Nsight Compute source pages
(`ncu -i REP --page source --print-source sass --csv`, e.g. the `*_src.csv` of
tools/device/ncu_w4a16_fused.sh or ncu_attention.sh): what a kernel spends its issue slots on.

    python3 tools/device/ncu_sass_mix.py [--top 22] [--loops 0.02] FILE.csv[.gz] ...

--loops F: instead, every loop of the listing (a backward branch's range, as tools/sass_loops.py finds them)
holding at least the fraction F of the stall samples: its length, HGMMA count, warp-instructions executed,
samples, and its top stall reasons (which loop of a warp-specialized kernel, consumer / prep / TMA, waits on what).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys


def sections(path: str) -> list[tuple[str, list[list[str]]]]:
    """The kernels of one source page, in order: (kernel name, its rows from its column header on). A page of
    a report with several launches holds one "Kernel Name" block per launch; each is counted on its own."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] or [0]
    out = []
    for a, b in zip(starts, [*starts[1:], len(rows)]):
        part = rows[a:b]
        name = part[0][1] if part and part[0] and part[0][0] == "Kernel Name" and len(part[0]) > 1 else "?"
        hdr = next(i for i, r in enumerate(part) if "Instructions Executed" in r)
        out.append((name, part[hdr:]))
    return out


def mix(rows: list[list[str]]) -> tuple[collections.Counter, collections.Counter]:
    """(warp-instructions by opcode, stall samples by opcode) of one kernel's rows (`sections`)."""
    cols = rows[0]
    ie, src, smp = (cols.index(c) for c in ("Instructions Executed", "Source", "Warp Stall Sampling (All Samples)"))
    inst, samples = collections.Counter(), collections.Counter()
    for r in rows[1:]:
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
    return inst, samples


def _sass_loops():
    """tools/sass_loops.py (its backward-branch loop finder), loaded by path: tools/ is not a package."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "sass_loops", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sass_loops.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _num(x: str) -> int:
    x = x.replace(",", "")
    return int(x) if x.isdigit() else 0


def loops(rows: list[list[str]], min_frac: float) -> list[str]:
    """One line per loop of one kernel's rows (`sections`) with at least `min_frac` of its stall samples
    (see --loops)."""
    cols = rows[0]
    stall = [c for c in cols if c.startswith("stall_")]
    ins = []  # (address, source, executed, samples, {stall reason: samples})
    for r in rows[1:]:
        if len(r) < len(cols):
            continue
        try:
            addr = int(r[0], 16)
        except ValueError:
            continue
        d = dict(zip(cols, r))
        ins.append((addr, d["Source"], _num(d["Instructions Executed"]),
                    _num(d["Warp Stall Sampling (All Samples)"]), {c: _num(d[c]) for c in stall}))
    spans = sorted(set(_sass_loops().loops([(a, src) for a, src, *_ in ins])))
    total = max(1, sum(x[3] for x in ins))
    out = []
    for s, e in spans:
        seg = ins[s:e + 1]
        smp = sum(x[3] for x in seg)
        if smp < min_frac * total:
            continue
        reasons = collections.Counter()
        for x in seg:
            reasons.update(x[4])
        hg = sum("HGMMA" in x[1] for x in seg)
        out.append(f"  loop {ins[s][0]:#x}-{ins[e][0]:#x}: {e - s + 1} instructions, HGMMA {hg}, executed "
                   f"{sum(x[2] for x in seg)}, samples {smp} ({100 * smp / total:.1f}%): "
                   + ", ".join(f"{k[6:]} {v}" for k, v in reasons.most_common(7)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--loops", type=float, default=None, help="per loop, those with this fraction of the samples")
    args = ap.parse_args(argv)
    for path in args.files:
        try:
            kernels = sections(path)
        except (OSError, StopIteration, ValueError) as e:
            print(f"== {path}: not an ncu source page ({type(e).__name__}: {e})")
            continue
        for name, rows in kernels:
            if args.loops is not None:
                print(f"== {path}: {name}: loops with >= {100 * args.loops:.0f}% of the stall samples")
                print("\n".join(loops(rows, args.loops)))
                continue
            inst, samples = mix(rows)
            n, s = sum(inst.values()), sum(samples.values())
            print(f"== {path}: {name}: {n} warp-instructions, {s} stall samples")
            for op, c in inst.most_common(args.top):
                print(f"  {op:10s} {c:11d} {100 * c / max(n, 1):5.1f}%   samples {100 * samples[op] / max(s, 1):5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
