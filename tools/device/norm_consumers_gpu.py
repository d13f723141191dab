"""GPU check of the fused norm in the consumer warpgroups (`mosaic_gpu.norm_in_consumers`: x g in the B
fragments, x^2 summed from them) against the producer's pass and finish (QSPEC_W4A16_NORM_PASS=1). Not in CI.

    PYTHONPATH=. python3 tools/device/norm_consumers_gpu.py [--ms 1,8,32] [--shapes s_qkv,s_gate_up] [--k-tile 192]

Per shape (K, N; gate_up shapes with SiLU·up) and row count M, on fresh random inputs: the kernel with the
norm in the consumers, twice (a race would give other bits), each row of the call against the row alone
(bit for bit: a row's sums do not depend on M), the kernel with the producer's pass (other bits expected:
x^2 is summed in another order), and both against `epilogue_reference` on the host CPU (relative error of
the bf16 output, the check's TOL_BF16). Each launch shape is the model's (`default_config` with the epilogue);
--k-tile replaces its k_tile for the consumers' runs (e.g. 192 at K 576: three stages of three k blocks; the
pass, which takes k_tile 64 / 128 / 256 only, runs at 64 where the model's is another). The norm without
weight (`unit_norm`: the draft's norms folded into its weights) against the kernel given a weight of ones, bit for
bit, in the consumers and in the pass.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.w4a16 import TOL_BF16  # noqa: E402

SHAPES = {"s_qkv": (576, 960, False), "s_gate_up": (576, 3072, True), "qkv": (4096, 6144, False),
          "gate_up": (4096, 28672, True)}  # the 8B's (K 4096) keep the producer's pass: a control


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,32")
    ap.add_argument("--shapes", default="s_qkv,s_gate_up")
    ap.add_argument("--k-tile", type=int, default=0, help="k_tile of the consumers' runs (0: the model's)")
    args = ap.parse_args()
    key = jax.random.PRNGKey(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run
    fails = 0
    for name in args.shapes.split(","):
        k, n, swiglu = SHAPES[name]
        epi = mg.Epilogue(norm=True, swiglu=swiglu)
        for m in map(int, args.ms.split(",")):
            key, kw, kx, kg = jax.random.split(key, 4)
            q = jax.random.randint(kw, (k, n), 0, 16).astype(jnp.uint8)
            packed = (q[0::2] | (q[1::2] << 4)).astype(jnp.uint8)
            scale = jax.random.uniform(kg, (k // 32, n), jnp.float32, 0.005, 0.02).astype(jnp.float16)
            zero = jnp.full((k // 32, n), -0.08, jnp.float16)
            p = lay.pack_fields(packed, scale, zero)
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
            gw = (1.0 + 0.3 * jax.random.normal(jax.random.fold_in(kg, 1), (k,), jnp.float32)).astype(jnp.bfloat16)

            cfg = mg.default_config(k, n, 32, epilogue=epi)
            pass_cfg = cfg if cfg.k_tile in (64, 128, 256) else cfg.replace(k_tile=64)  # the pass's k tiles
            cfg = cfg.replace(k_tile=args.k_tile) if args.k_tile else cfg

            def run(pass_env: str):
                os.environ["QSPEC_W4A16_NORM_PASS"] = pass_env
                c = cfg if pass_env == "0" else pass_cfg  # the pass at the model's shape where it can run
                f = jax.jit(lambda x, p, gw: mg.int4_matmul_mgpu(x, p, norm_weight=gw, swiglu=swiglu, config=c))
                return np.asarray(f(x, p, gw)).view(np.uint16)

            try:
                a, b, old = run("0"), run("0"), run("1")
                os.environ["QSPEC_W4A16_NORM_PASS"] = "0"
                one = jax.jit(lambda x, p, gw: mg.int4_matmul_mgpu(x, p, norm_weight=gw, swiglu=swiglu, config=cfg))
                rows_bad = sum(int(not np.array_equal(np.asarray(one(x[i:i + 1], p, gw)).view(np.uint16)[0], a[i]))
                               for i in range(min(m, 4)))
                unit_bad = 0  # the norm without weight against a weight of ones, consumers then pass
                for pass_env in ("0", "1"):
                    os.environ["QSPEC_W4A16_NORM_PASS"] = pass_env
                    c = cfg if pass_env == "0" else pass_cfg
                    unit = jax.jit(lambda x, p: mg.int4_matmul_mgpu(x, p, unit_norm=True, swiglu=swiglu, config=c))
                    ones = jax.jit(lambda x, p, g1: mg.int4_matmul_mgpu(x, p, norm_weight=g1, swiglu=swiglu, config=c))
                    unit_bad += int((np.asarray(unit(x, p)).view(np.uint16)
                                     != np.asarray(ones(x, p, jnp.ones_like(gw))).view(np.uint16)).sum())
            finally:
                os.environ.pop("QSPEC_W4A16_NORM_PASS", None)
            cpu = jax.devices("cpu")[0]
            with jax.default_device(cpu):
                xc, pc, gc = jax.device_put((x, p, gw), cpu)
                ref = np.asarray(mg.epilogue_reference(xc, lay.dequantize_bf16(pc).astype(jnp.float32), epi,
                                                       norm_weight=gc), np.float32)
            f32 = lambda u: u.astype(np.uint32).__lshift__(16).view(np.float32)  # noqa: E731
            rel = float(np.abs(f32(a) - ref).max() / max(np.abs(ref).max(), 1e-30))
            rel_old = float(np.abs(f32(old) - ref).max() / max(np.abs(ref).max(), 1e-30))
            same, det = int((a != old).sum()), int((a != b).sum())
            ok = det == 0 and rows_bad == 0 and rel <= TOL_BF16 and unit_bad == 0
            fails += not ok
            print(f"{name:9s} M={m:2d} wgs {cfg.wgs} kt {cfg.k_tile} s {cfg.splits}: "
                  f"rel {rel:.2e} (pass {rel_old:.2e}), "
                  f"{same} of {a.size} elements differ from the pass, {det} between two runs, {rows_bad} rows differ "
                  f"alone, {unit_bad} unit-norm elements differ from ones: {'ok' if ok else 'FAIL'}", flush=True)
    print("ALL OK" if not fails else f"{fails} FAILED")
    return int(bool(fails))


if __name__ == "__main__":
    sys.exit(main())
