"""GPU check + A/B timing of `MgpuConfig.mma_chains` (the "mma" INT4 kernel's accumulator chains per stage).

    PYTHONPATH=. python3 tools/device/w4a16_chains_gpu.py [--shapes qkv,o,gate_up,down,s_qkv,s_down] [--m 1,8]

For each draft shape (G = 32, the model's launch shape for M rows) and each chain count 1, 2, 4:
the output against the float32 oracle x @ dequantize_bf16(W) (fresh random inputs), against the
one-chain kernel (a changed summation order moves a few outputs by a bf16 step at most), two
calls bitwise equal, and the time in the in-device loop over L2-defeating weight copies
(`w4a16_config_sweep.time_config`). Prints one line per (shape, M, chains) and FAIL lines.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.w4a16 import BENCH_SHAPES as SHAPES  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from w4a16_config_sweep import L2_DEFEAT, time_config, weights  # noqa: E402


def rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,s_qkv,s_down")
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--chains", default="1,2,4")
    args = ap.parse_args(argv)
    key = jax.random.PRNGKey(int.from_bytes(os.urandom(4), "little"))  # fresh inputs per run
    bad = 0
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        g = 32
        nbytes = lay.packed_bytes(k, n, g)
        copies = max(2, min(8, -(-L2_DEFEAT // nbytes)))
        ws = weights(key, k, n, g, copies)
        w_f32 = lay.dequantize_bf16(ws[0]).astype(jnp.float32)
        for m in (int(v) for v in args.m.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
            oracle = jnp.dot(x.astype(jnp.float32), w_f32, precision=lax.Precision.HIGHEST)
            base = mg.default_config(k, n, g, reduce=mg.reduce_mode(m, False))
            iters = max(2, int(2e-3 / (nbytes / 3e12) / copies))
            one = None
            for c in (int(v) for v in args.chains.split(",")):
                cfg = base.replace(mma_chains=c)
                f = jax.jit(lambda x, w, cfg=cfg: mg.int4_matmul_mgpu(x, w, config=cfg))
                y1, y2 = f(x, ws[0]), f(x, ws[0])
                sec, _ = time_config(cfg, x, ws, iters)
                e_or = rel(y1, oracle)
                e_one = 0.0 if one is None else rel(y1, one)
                det = bool(jnp.array_equal(y1, y2))
                ok = e_or < 5e-3 and e_one < 5e-3 and det
                bad += not ok
                if one is None:
                    one = y1
                print(f"{name:8s} M={m:2d} chains={c}  {sec * 1e6:8.2f} us  rel vs oracle {e_or:.1e}  vs 1 chain "
                      f"{e_one:.1e}  deterministic {det}  wgs{cfg.wgs} kt{cfg.k_tile} S{cfg.splits} {cfg.reduce}"
                      f"{'' if ok else '  FAIL'}", flush=True)
    print("ALL OK" if not bad else f"{bad} FAILED", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
