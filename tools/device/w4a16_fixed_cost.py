"""Where a small INT4 linear's fixed cost goes: time against K at fixed N, fitted to t = t0 + bytes / rate.

    PYTHONPATH=. python3 tools/device/w4a16_fixed_cost.py [--n 4096,6144] [--k 512,1024,2048,4096] [--m 1]

The L2 probe (l2_hot_probe.py, 2026-11-28) showed the draft's small linears (o, qkv) do not wait on
HBM: an L2-resident weight is no faster. This script separates what does not scale with the weight
(t0: launch, barrier setup, the ring's first round trip, the split-K sum, the epilogue) from what
does (the per-byte rate once streaming), for the launch shape the model uses at each (K, N) and,
with --diag, for the kernel's "stream" diagnostic (TMA ring only, no conversion or MMA: wrong
results, timing only). In-device loops over L2-defeating weight copies (w4a16_config_sweep).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_config_sweep import L2_DEFEAT, time_config, weights  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="4096,6144")
    ap.add_argument("--k", default="512,1024,2048,4096")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--diag", action="store_true", help="also the TMA-ring-only diagnostic of each shape")
    ap.add_argument("--stages", default="0", help="comma list of ring depths (0: the launch shape's own)")
    args = ap.parse_args(argv)
    g = 32
    key = jax.random.PRNGKey(0)
    ceiling = read_ceiling_bps()
    runs = [(n, st, diag) for n in (int(v) for v in args.n.split(",")) for st in (int(v) for v in args.stages.split(","))
            for diag in (("", "stream") if args.diag else ("",))]
    for n, stages, diag in runs:
        pts = []
        for k in (int(v) for v in args.k.split(",")):
            nbytes = lay.packed_bytes(k, n, g)
            copies = max(2, min(16, -(-L2_DEFEAT // nbytes)))
            ws = weights(key, k, n, g, copies)
            x = jax.random.normal(jax.random.fold_in(key, k), (args.m, k), jnp.float32).astype(jnp.bfloat16)
            cfg = mg.default_config(k, n, g, reduce=mg.reduce_mode(args.m, False)).replace(diag=diag)
            cfg = cfg.replace(stages=stages or cfg.stages)
            iters = max(2, int(2e-3 / (nbytes / 3e12) / copies))
            sec, _ = time_config(cfg, x, ws, iters)
            pts.append((nbytes, sec * 1e6))
            print(f"N={n} K={k:5d} {diag or 'full':6s} {sec * 1e6:8.2f} us  floor {nbytes / ceiling * 1e6:6.2f} us  "
                  f"wgs{cfg.wgs} kt{cfg.k_tile} S{cfg.splits} {cfg.reduce} stages {cfg.stages}", flush=True)
        b, t = np.array(pts, dtype=np.float64).T
        slope, t0 = np.polyfit(b, t, 1)
        print(f"== N={n} stages {stages or 'default'} {diag or 'full'}: t0 {t0:.2f} us, streaming {1e-6 / slope:.2f} TB/s "
              f"({1e-6 / slope / (ceiling / 1e12):.0%} of the ceiling)  (launch shapes differ by K)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
