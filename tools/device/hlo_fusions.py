"""Print what named XLA fusions compute, from an XLA dump (`--xla_dump_to=DIR --xla_dump_hlo_as_text`).

    python3 tools/device/hlo_fusions.py DIR --has dense_decode --names loop_slice_fusion,loop_pad_fusion [--lines 40]

For every optimized module (`*after_optimizations.txt`) whose text contains --has, prints each fusion
instruction named in --names (its call line: operand shapes, output shape) and the fused computation it calls
(its first --lines lines). How the profile's glue kernels (`qspec-bench profile`, by fusion name) were read.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump_dir")
    ap.add_argument("--has", default="", help="only modules whose optimized HLO contains this text")
    ap.add_argument("--names", required=True, help="comma-separated fusion instruction names")
    ap.add_argument("--lines", type=int, default=40)
    a = ap.parse_args()
    names = [n for n in a.names.split(",") if n]
    files = sorted(glob.glob(os.path.join(a.dump_dir, "*after_optimizations.txt")), key=os.path.getsize, reverse=True)
    for f in files:
        txt = open(f).read()
        if a.has and a.has not in txt:
            continue
        print(f"######## {os.path.basename(f)} ({len(txt)} chars)")
        for n in names:
            m = re.search(rf"^\s*(?:ROOT )?%?{re.escape(n)} = .*$", txt, re.M)
            if not m:
                print(f"== {n}: not in this module")
                continue
            call = m.group(0).strip()
            print(f"== {n}: {call[:600]}")
            c = re.search(r"calls=([%\w.\-]+)", call)
            if c:
                comp = c.group(1).lstrip("%")
                body = re.search(rf"^%?{re.escape(comp)} .*?^}}", txt, re.M | re.S)
                if body:
                    print("\n".join(body.group(0).splitlines()[: a.lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
