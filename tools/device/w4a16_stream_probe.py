"""What holds the INT4 linears' TMA ring below the read ceiling (issue 32)? Times the Mosaic GPU W4A16
kernel and its stream-only diagnostic (`MgpuConfig(diag="stream")`: the producer's ring with consumers that only
wait and release) over launch shapes that change one thing at a time: the code words' TMA box (wgs x k_tile x 32 bytes: 8 KB at
wgs 1 / kt 256 or wgs 2 / kt 128, 16 KB at wgs 2 / kt 256, 32 KB at wgs 2 / kt 512 or wgs 4 / kt 256), the bytes in
flight (stages x stage bytes per CTA, one or two CTAs per SM) and the CTA count. Not in CI.

    PYTHONPATH=. python3 tools/device/w4a16_stream_probe.py [--n 28672,33792] [--m 1]
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

SHAPES = [(2, 256, 4), (2, 256, 8), (2, 512, 2), (2, 512, 3), (4, 256, 4), (4, 128, 6), (4, 128, 8), (1, 256, 8),
          (2, 128, 8), (1, 512, 4)]  # (wgs, k_tile, stages)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="28672,33792")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=1)
    args = ap.parse_args()
    k, g = args.k, 32
    key = jax.random.PRNGKey(0)
    for n in (int(v) for v in args.n.split(",")):
        nbytes = lay.packed_bytes(k, n, g)
        copies = max(1, min(8, -(-L2_DEFEAT // nbytes)))
        ws = weights(key, k, n, g, copies)
        x = jax.random.normal(jax.random.fold_in(key, 99), (args.m, k), jnp.float32).astype(jnp.bfloat16)
        iters = max(2, int(2e-3 / (nbytes / 3e12) / copies))
        floor = nbytes / read_ceiling_bps() * 1e6
        for wgs, kt, st in SHAPES:
            # a stage as the kernel sizes it (`mosaic_gpu._stages_for`): the codes (4 bits a weight), one
            # 4-byte record per row and group, the x tile of rows_for(M) rows
            box = wgs * kt * lay.ROWS // 2
            stage = box + wgs * lay.ROWS * (kt // g) * 4 + mg.rows_for(args.m) * kt * 2
            line = (f"N {n:6d} wgs{wgs} kt{kt:3d} st{st}  CTAs {n // (lay.ROWS * wgs):4d}  box {box // 1024:2d} KB  "
                    f"stage {stage / 1024:4.1f} KB")
            for diag in ("stream", ""):
                cfg = mg.MgpuConfig(wgs=wgs, k_tile=kt, splits=1, stages=st, reduce="gmem", tma_view="wide",
                                    diag=diag, mma_chains=2)
                try:
                    sec, _ = time_config(cfg, x, ws, iters)
                    line += f"  {diag or 'full':6s} {sec * 1e6:7.2f} us ({floor / (sec * 1e6):4.0%})"
                except Exception as e:  # noqa: BLE001 - a launch shape that does not fit is a result
                    line += f"  {diag or 'full':6s} FAILED {type(e).__name__}: {str(e)[:80]}"
            print(line + f"  floor {floor:.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
