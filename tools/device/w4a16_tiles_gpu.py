"""How the INT4 kernel's time grows with its number of row tiles (issue 32: is the large linears'
gap load imbalance?). Times one launch shape (wgs 2, k tile 256, one split: 128 rows of N per CTA)
at K = 4096 and N giving 132, 176, 224 (the 8B gate_up) and 264 tiles. If 224 tiles cost what 264 do,
the SMs holding two tiles set the time, and a balanced (stream-K) split would take 224/264 of it.

    PYTHONPATH=. python3 tools/device/w4a16_tiles_gpu.py [--m 1,8] [--k 4096]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools", "device"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402
from w4a16_config_sweep import L2_DEFEAT, time_config, weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--tiles", default="66,132,176,224,264")
    ap.add_argument("--wgs", type=int, default=2)
    args = ap.parse_args()
    g, k = 32, args.k
    ceiling = read_ceiling_bps()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for m in (int(v) for v in args.m.split(",")):
        for tiles in (int(v) for v in args.tiles.split(",")):
            n = tiles * 64 * args.wgs
            cfg = mg.MgpuConfig(wgs=args.wgs, k_tile=256, splits=1, reduce="cluster", stages=4, tma_view="wide")
            nbytes = lay.packed_bytes(k, n, g)
            copies = max(2, -(-L2_DEFEAT // int(nbytes)))
            ws = weights(jax.random.PRNGKey(0), k, n, g, copies)
            x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
            s, _ = time_config(cfg, x, ws, iters=20)
            print(f"M={m:2d} K={k} N={n:6d} tiles={tiles:3d}: {s * 1e6:7.2f} us, {nbytes / s / 1e12:.2f} TB/s "
                  f"({nbytes / s / ceiling:.0%} of ceiling), {s * 1e6 / tiles:.3f} us per tile", flush=True)


if __name__ == "__main__":
    main()
