"""Is a small INT4 linear bound by its weights' DRAM latency, or by the kernel's own fixed costs?

    PYTHONPATH=. python3 tools/device/l2_hot_probe.py [--shapes qkv,o,gate_up,down] [--m 1,8]

For each 8B draft shape (G = 32, the model's launch shape) the same kernel is timed in two in-device
loops: over enough weight copies to defeat the L2 (the weights stream from HBM, as in a decode step)
and over one copy (a weight that fits in the 50-60 MB L2 is read from there after the first call).
If the L2-resident time is far below the HBM time, prefetching the next linear's weights into the
L2 (during the attention or the previous linear) would pay; if not, the fixed cost is inside the
kernel (fill, sync, epilogue). Timing only; both loops check they return the same bits.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402
from qspec_jax.bench.w4a16 import BENCH_SHAPES as SHAPES  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_config_sweep import L2_DEFEAT, time_config, weights  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args(argv)
    key = jax.random.PRNGKey(0)
    ceiling = read_ceiling_bps()
    print(f"{'shape':8s} {'M':>3s} {'MB':>6s} {'floor':>7s} {'HBM us':>8s} {'L2 us':>8s} {'L2/HBM':>7s}  config")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        g = args.group
        nbytes = lay.packed_bytes(k, n, g)
        cold = max(2, min(8, -(-L2_DEFEAT // nbytes)))
        ws = weights(key, k, n, g, cold)
        for m in (int(v) for v in args.m.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
            cfg = mg.default_config(k, n, g, reduce=mg.reduce_mode(m, False))
            iters = max(2, int(2e-3 / (nbytes / 3e12) / cold))
            t_hbm, y_hbm = time_config(cfg, x, ws, iters)
            t_l2, y_l2 = time_config(cfg, x, ws[:1], iters * cold)
            same = bool(jnp.array_equal(y_hbm, y_l2))
            print(f"{name:8s} {m:3d} {nbytes / 2**20:6.1f} {nbytes / ceiling * 1e6:7.2f} {t_hbm * 1e6:8.2f} "
                  f"{t_l2 * 1e6:8.2f} {t_l2 / t_hbm:7.2f}  wgs{cfg.wgs} kt{cfg.k_tile} S{cfg.splits} {cfg.reduce}"
                  f"{'' if same else '  OUTPUTS DIFFER'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
