"""GPU check of the bf16 kernel's row blocks (`mosaic_gpu.bf16_matmul_mgpu` above MAX_M rows, `dense_blocks`: a
verify's B x T rows in one launch; not in CI).

    PYTHONPATH=. python3 tools/device/check_dense_blocks.py [--rows 70,96,128,256] [--shapes s_qkv,s_o,s_gu,s_down,o]
        [--time-rows 96] [--layers 4]

1. Per shape (a stack of --layers weights, fresh random inputs) and row count: the blocked call against the float32
   reference (relative error < 1e-2), every row bit for bit the row alone (the kernel's row invariance, so the
   verify's rows equal the AR step's), two calls bit for bit equal; SiLU·up (gate | up) the same.
2. Timing at --time-rows rows per shape: kernel time a call (profiler trace, all kernels of the call) and the
   loop's wall a call, for the blocked launch, the former two launches (MAX_M rows, then the rest, concatenated)
   and cuBLAS on the layer's slice.
Prints OK / FAIL lines and exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402

# name: (K, N, swiglu): SmolLM2's target linears (q|k|v, o, gate | up with SiLU·up, down) and the 8B's o
SHAPES = {"s_qkv": (576, 960, False), "s_o": (576, 576, False), "s_gu": (576, 3072, True),
          "s_gu_plain": (576, 3072, False), "s_down": (1536, 576, False), "o": (4096, 4096, False)}


def _bf(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale).astype(jnp.bfloat16)


def check(name: str, rows: list[int], n_layers: int, seed: int) -> bool:
    k, n, swiglu = SHAPES[name]
    rng = np.random.default_rng(seed)
    w = _bf(rng, n_layers, k, n, scale=k ** -0.5)
    f = jax.jit(lambda x, i: mg.bf16_matmul_mgpu(x, w, layer=i, swiglu=swiglu))
    ok = True
    for m in rows:
        layer = int(rng.integers(n_layers))
        x = _bf(rng, m, k)
        y = np.asarray(f(x, layer))
        ref = np.asarray(mg.epilogue_reference(x, w[layer].astype(jnp.float32), mg.Epilogue(swiglu=swiglu),
                                               out_dtype=jnp.float32), np.float64)
        rel = float(np.linalg.norm(y.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))
        again = np.array_equal(y.view(np.uint16), np.asarray(f(x, layer)).view(np.uint16))
        alone = np.concatenate([np.asarray(f(x[i:i + 1], layer)) for i in range(m)])
        bad_rows = int(np.sum(np.any(alone.view(np.uint16) != y.view(np.uint16), axis=1)))
        good = rel < 1e-2 and again and bad_rows == 0
        ok &= good
        print(f"{'OK' if good else 'FAIL'} {name} K={k} N={n} swiglu={swiglu} M={m} blocks={mg.dense_blocks(m)} "
              f"rel={rel:.2e} deterministic={again} rows_unlike_alone={bad_rows}", flush=True)
    return ok


def time_shape(name: str, m: int, n_layers: int) -> None:
    from qspec_jax.bench.timing import time_loop

    k, n, swiglu = SHAPES[name]
    rng = np.random.default_rng(5)
    w, x = _bf(rng, n_layers, k, n, scale=k ** -0.5), _bf(rng, m, k)

    def blocked(i, x, d):
        return mg.bf16_matmul_mgpu(x, d, layer=i % n_layers, swiglu=swiglu)

    def two_calls(i, x, d):  # the former dense_linear: MAX_M rows, then the rest, each its own launch
        parts = [jax.lax.optimization_barrier(x[s:s + mg.MAX_M]) for s in range(0, m, mg.MAX_M)]
        return jnp.concatenate([mg.bf16_matmul_mgpu(p, d, layer=i % n_layers, swiglu=swiglu) for p in parts])

    def cublas(i, x, d):
        y = jnp.dot(x, jax.lax.dynamic_index_in_dim(d, i % n_layers, keepdims=False))
        if swiglu:
            g, u = jnp.split(y, 2, axis=-1)
            y = jax.nn.silu(g) * u
        return y

    for label, fn in (("blocked", blocked), ("two_calls", two_calls), ("cublas", cublas)):
        def step(c, d, fn=fn):
            i, x = c
            return i + 1, x + fn(i, x, d)[:, :1].astype(x.dtype) * 0

        with tempfile.TemporaryDirectory() as td:
            r = time_loop(step, (jnp.int32(0), x), reps=64, trials=3, data=w, trace_dir=td)
        ks = {kn: us for kn, us in r["kernels"].items() if us > 0.3}
        print(f"  time {name} M={m} {label:9s}: wall {r['s'] * 1e6:7.2f} us/call, kernels "
              f"{sum(ks.values()):7.2f} us ({len(ks)}: " + ", ".join(f"{kn[:40]} {us:.2f}" for kn, us in ks.items())
              + f"); byte floor {k * n * 2 / 4.35e12 * 1e6:.2f} us (H200)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="70,96,128,256")
    ap.add_argument("--shapes", default="s_qkv,s_o,s_gu,s_down,o")
    ap.add_argument("--time-rows", default="96")
    ap.add_argument("--time-shapes", default="s_qkv,s_o,s_gu_plain,s_down")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = [int(v) for v in args.rows.split(",") if v]
    ok = True
    for i, name in enumerate(s for s in args.shapes.split(",") if s):
        ok &= check(name, rows, args.layers, seed=100 + i)
    for m in (int(v) for v in args.time_rows.split(",") if v):
        for name in (s for s in args.time_shapes.split(",") if s):
            time_shape(name, m, args.layers)
    print("ALL OK" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
