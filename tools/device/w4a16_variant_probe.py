"""The INT4 skinny GEMM's two register variants against each other at decode row counts (GPU only; not in CI).

    PYTHONPATH=. python3 tools/device/w4a16_variant_probe.py [--shapes s_qkv,s_o,s_gate_up,s_down] [--ms 8,32,64]

`variant="mma"` (warp-level mma.sync.m16n8k16, the default) and `variant="wgmma"` (the warpgroup MMA with the
dequantized register A operand) were compared at batch 1 only (8B, 2026-12-04: wgmma 3-10% slower). At M 32 a
pipeline stage of the "mma" kernel is 4 n8 MMAs per k16 step and warp, where one wgmma m64n32k16 covers the
warpgroup's; the cluster tail measured its MMAs at ~6.5 of its 25.9 us on 16 SMs (kernel_notes, fifty-first
session), so whether the other instruction is cheaper at 32 rows decides where that goes next. For each shape and
row count: the default launch shape with each variant (same config, so the same k order: outputs compared), and
cuBLAS bf16 on the dequantized weight, each in an in-device loop over `--copies` weight copies chained by
optimization barriers (`w4a16_config_sweep.time_chained`). Measured (H100, 2026-12-05): wgmma / mma 1.08-1.10 at
M 8, 0.99-1.13 at M 32, 0.88-1.01 at M 64; mma.sync stays (kernel_notes, "Fifty-first session")."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.w4a16 import BENCH_SHAPES as SHAPES  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_config_sweep import time_chained, weights  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="s_qkv,s_o,s_gate_up,s_down")
    ap.add_argument("--ms", default="8,32,64")
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    key = jax.random.PRNGKey(int(time.time()))  # fresh inputs every run
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        ws = weights(jax.random.fold_in(key, k * n), k, n, 32, args.copies)
        dense = [lay.dequantize_bf16(w) for w in ws]
        for m in (int(v) for v in args.ms.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k)).astype(jnp.bfloat16)
            cfg = mg.default_config(k, n, 32, reduce=mg.reduce_mode(m, False))
            row = {}
            outs = {}
            for variant in ("mma", "wgmma"):
                try:
                    t, y = time_chained(lambda xi, w, v=variant: mg.int4_matmul_mgpu(xi, w, config=cfg, variant=v),
                                        x, ws, args.iters)
                    row[variant], outs[variant] = t * 1e6, np.asarray(y, np.float32)
                except Exception as e:  # noqa: BLE001  (a variant that does not lower at this shape: say so)
                    row[variant] = float("nan")
                    print(f"{name} M={m} {variant}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            t, _ = time_chained(lambda xi, w: jnp.dot(xi, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                                x, dense, args.iters)
            row["cublas"] = t * 1e6
            rel = (float(np.abs(outs["mma"] - outs["wgmma"]).max() / (np.abs(outs["mma"]).max() + 1e-30))
                   if len(outs) == 2 else float("nan"))
            print(f"{name} k{k} n{n} M={m} {cfg}: " + "  ".join(f"{v} {t:6.2f} us" for v, t in row.items())
                  + f"  wgmma/mma {row['wgmma'] / row['mma']:.3f}  max rel diff {rel:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
