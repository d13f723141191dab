"""The in-kernel split-K sum through global memory (MgpuConfig.reduce = "sem", issue 32) on the GPU: for the
8B draft's linears, each split launch shape with its partials summed by XLA ("gmem"), in a cluster and by the
last split ("sem"): time, and the "sem" output against the "gmem" one of the same shape bit for bit (the same
order of additions), with and without the residual epilogue; and with the fused norm (qkv's, gate_up's
glue), "sem" against the cluster sum bit for bit (partials and row sums x^2 added in the same order).

    PYTHONPATH=. python3 tools/device/w4a16_sem_gpu.py [--m 1,8] [--shapes down,o,qkv]
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
from w4a16_config_sweep import L2_DEFEAT, time_config, weights  # noqa: E402

SPLITS = {"down": [(2, 256, 4), (1, 256, 2), (2, 64, 8)], "o": [(2, 256, 8), (1, 256, 2), (2, 128, 4)],
          "qkv": [(2, 128, 8), (2, 128, 4), (1, 256, 2)], "gate_up": [(2, 256, 2)],
          "s_down": [(1, 256, 3), (1, 192, 4), (1, 128, 6), (1, 192, 2)]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--shapes", default="down,o,qkv")
    args = ap.parse_args()
    g, bad = 32, 0
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        nbytes = lay.packed_bytes(k, n, g)
        copies = max(1, min(8, -(-L2_DEFEAT // nbytes)))
        ws = weights(jax.random.PRNGKey(0), k, n, g, copies)
        for m in (int(v) for v in args.m.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
            res = jax.random.normal(jax.random.PRNGKey(2), (m, n), jnp.float32).astype(jnp.bfloat16)
            gw = (1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(3), (k,), jnp.float32)).astype(jnp.bfloat16)
            iters = max(2, int(2e-3 / (nbytes / 3e12) / copies))
            d = mg.default_config(k, n, g, reduce=mg.reduce_mode(m, False))
            s_d, _ = time_config(d, x, ws, iters)
            print(f"{name:7s} M={m} default {s_d * 1e6:7.2f} us  wgs{d.wgs} kt{d.k_tile} S{d.splits} {d.reduce}", flush=True)
            for wgs, kt, s in SPLITS[name]:
                outs, line = {}, []
                for red in ("gmem", "cluster", "sem"):
                    if red == "cluster" and (m > 24 or s > mg.MAX_CLUSTER):
                        continue
                    cfg = mg.MgpuConfig(wgs=wgs, k_tile=kt, splits=s, reduce=red, stages=4, tma_view="wide")
                    try:
                        sec, y = time_config(cfg, x, ws, iters)
                    except Exception as e:  # noqa: BLE001 - a failure is a result
                        line.append(f"{red} FAILED {type(e).__name__}: {str(e)[:120]}")
                        bad += 1
                        continue
                    outs[red] = np.asarray(y.astype(jnp.float32))
                    yr = mg.int4_matmul_mgpu(x, ws[0], config=cfg, residual=res)
                    outs[red + "+res"] = np.asarray(yr.astype(jnp.float32))
                    line.append(f"{red} {sec * 1e6:7.2f} us")
                    if red != "gmem" and m <= 24:  # the norm needs an in-kernel sum
                        yn = mg.int4_matmul_mgpu(x, ws[0], config=cfg, norm_weight=gw)
                        outs[red + "+norm"] = np.asarray(yn.astype(jnp.float32))
                ok = all(np.array_equal(outs["gmem" + t], outs["sem" + t]) for t in ("", "+res")
                         if "sem" + t in outs and "gmem" + t in outs)
                if "sem+norm" in outs and "cluster+norm" in outs:
                    norm_ok = np.array_equal(outs["sem+norm"], outs["cluster+norm"])
                    line.append(f"norm: sem == cluster bitwise {norm_ok}")
                    if not norm_ok:  # which one is off: each against the float32 reference
                        ref = np.asarray(mg.epilogue_reference(x, lay.dequantize_bf16(ws[0]).astype(jnp.float32),
                                                               mg.Epilogue(norm=True), norm_weight=gw
                                                               ).astype(jnp.float32))
                        scale = np.abs(ref).max()
                        for red in ("sem", "cluster"):
                            got = outs[red + "+norm"]
                            line.append(f"{red}+norm max |err| / max |ref| {np.abs(got - ref).max() / scale:.2e}")
                        line.append(f"{int((outs['sem+norm'] != outs['cluster+norm']).sum())} of "
                                    f"{ref.size} elements differ")
                    bad += not norm_ok
                bad += not ok
                print(f"{name:7s} M={m} wgs{wgs} kt{kt} S{s}: " + ", ".join(line)
                      + f"; sem == gmem bitwise (plain, residual): {ok}", flush=True)
    print(f"w4a16_sem_gpu: {bad} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
