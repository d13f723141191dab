"""The W4A16 kernel's fused RMSNorm (`Epilogue(norm=True)`) on the GPU against its float32 reference,
per launch shape (k tile 64 / 128 / 256, split sums "cluster" and "sem") and row count, and whether
two runs of the same call give the same bits (a race would not). Written for the 2026-11-27 finding
that at M 8, S 8 the "sem" and "cluster" norm outputs differed in 38% of the elements
(tools/device/w4a16_sem_gpu.py): the producer summed row slots that other threads of its warpgroup
had written in the last stage without a barrier (KT < 256).

    PYTHONPATH=. python3 tools/device/w4a16_norm_gpu.py [--m 1,2,5,8,16] [--shapes qkv,s_qkv]

A launch shape fails if two runs differ or its error exceeds 2^-8 of max |ref| (the bf16 output's
rounding: the kernel and the reference differ only in float32 summation order otherwise).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools", "device"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.w4a16 import BENCH_SHAPES as SHAPES  # noqa: E402
from w4a16_config_sweep import weights  # noqa: E402

# (wgs, k_tile, splits, reduce[, norm_ahead]); those whose split does not divide K are skipped
CONFIGS = [(1, 256, 1, "cluster"), (1, 128, 1, "cluster"), (1, 64, 1, "cluster"), (2, 64, 1, "cluster"),
           (1, 256, 2, "cluster"), (2, 128, 2, "cluster"), (2, 128, 4, "cluster"), (2, 128, 8, "cluster"),
           (2, 256, 8, "cluster"), (2, 128, 4, "sem"), (2, 128, 8, "sem"), (2, 128, 8, "cluster", 2)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,2,5,8,16")
    ap.add_argument("--shapes", default="qkv,s_qkv")
    args = ap.parse_args()
    g = 32
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    bad = 0
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        p = weights(jax.random.PRNGKey(0), k, n, g, 1)[0]
        wf = lay.dequantize_bf16(p).astype(jnp.float32)
        gw = (1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(3), (k,), jnp.float32)).astype(jnp.bfloat16)
        for m in (int(v) for v in args.m.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = np.asarray(mg.epilogue_reference(x, wf, mg.Epilogue(norm=True), norm_weight=gw)
                             .astype(jnp.float32))
            scale = np.abs(ref).max()
            for c in CONFIGS:
                wgs, kt, s, red = c[:4]
                ahead = c[4] if len(c) > 4 else 1
                if k % (kt * s) or (n // lay.ROWS) % wgs:  # not a launch shape of this weight
                    continue
                cfg = mg.MgpuConfig(wgs=wgs, k_tile=kt, splits=s, reduce=red, stages=4, tma_view="wide",
                                    norm_ahead=ahead)
                tag = f"{shape:6s} M={m:2d} wgs{wgs} kt{kt} S{s} {red:7s} ahead{ahead}"
                try:
                    y1, y2 = (np.asarray(mg.int4_matmul_mgpu(x, p, config=cfg, norm_weight=gw).astype(jnp.float32))
                              for _ in range(2))
                except Exception as e:  # noqa: BLE001 - a failure is a result
                    print(f"{tag}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                    bad += 1
                    continue
                err = np.abs(y1 - ref).max() / scale
                rows = np.abs(y1 - ref).max(axis=1) / scale
                same = np.array_equal(y1, y2)
                ok = same and err <= 2.0 ** -8
                print(f"{tag}: max |err| / max |ref| {err:.2e}, per row {' '.join(f'{v:.0e}' for v in rows[:16])}; "
                      f"deterministic {same} {'ok' if ok else 'FAIL'}", flush=True)
                bad += not ok
    print(f"w4a16_norm_gpu: {bad} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
