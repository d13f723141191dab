"""GPU check of the draft's fused q|k|v kernel (`mosaic_gpu.int4_qkv_cache_mgpu`, Epilogue.qkv; not in CI).

    PYTHONPATH=. python3 tools/device/qkv_cache_gpu.py [--batches 1,3,8,24] [--layers 4] [--shapes 8b,smollm2]
        [--tokens 1,5] [--kinds int4,bf16]

1. The kernel (with the norm's weight, and without: `unit_norm`, against the reference with a weight of ones) at
   the 8B heads (Hq 32, Hkv 8, D 128, K 4096, a stack of --layers layers, ring 288) and at
   SmolLM2's (Hq 9, Hkv 3, D 64, K 576: one head per warpgroup, one warpgroup per CTA) with
   fresh random inputs against `qkv_cache_reference` (float32): every written element within one bf16 step
   (plus the float32 summation order near zero: BF16_STEP, SUM_ORDER),
   every other element of the query operand and the rings untouched, two calls bit for bit equal. --tokens: T
   tokens per batch row (x [B T, K], the verify's rows); --kinds bf16: the same checks of the bf16 kernel
   (`bf16_qkv_cache_mgpu`, a target's q|k|v without norm) on the INT4 weight's bf16 values.
3. --parts sweep: the bf16 kernel's launch shapes at the 8B's q|k|v (the qkv epilogue) or other linears (plain;
   --sweep-linears), B 1, T --tokens, kernel time from a trace, cuBLAS beside it.
2. The model: one draft decode step of an 8B- and a SmolLM2-shaped model (--layers layers, random
   weights, a random QuantSpecCache) with the fused kernel (QSPEC_QKV_CACHE=all) and without: logits and
   rings close, the rings' other slots bit for bit the same. Prints OK / FAIL lines and exits 1 on any failure.
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


# A written element may differ from the float32 reference by one bf16 rounding step (2^-7 of it:
# the kernel's float32 sums run in another order, which can move a value across a rounding
# boundary) plus the float32 order difference itself, which matters only near zero (2^-10 of the
# buffer's largest value bounds it with room).
BF16_STEP, SUM_ORDER = 2.0 ** -7, 2.0 ** -10


def _bf(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)


# (Hq, Hkv, D, K, rope theta) per --shapes name
SHAPES = {"8b": (32, 8, 128, 4096, 500_000.0), "smollm2": (9, 3, 64, 576, 100_000.0)}


def check_kernel(b: int, n_layers: int, seed: int, shape: str = "8b", unit: bool = False, tokens: int = 1,
                 dense: bool = False) -> bool:
    """`unit`: the norm without weight (`unit_norm`), against the reference with a weight of ones;
    `tokens`: T tokens per batch row (x [B T, K]); `dense`: the bf16 kernel (`bf16_qkv_cache_mgpu`, no
    norm) on the INT4 weight's bf16 values."""
    rng = np.random.default_rng(seed)
    hq, hkv, dh, k, theta = SHAPES[shape]
    m = b * tokens
    ring, cn, g = 288, 16 * -(-tokens * (hq // hkv) // 16), 32
    n = (hq + 2 * hkv) * dh
    packed = rng.integers(0, 256, (n_layers, k // 2, n), dtype=np.uint8)
    scale = rng.uniform(0.005, 0.02, (n_layers, k // g, n)).astype(np.float16)
    zero = rng.uniform(-0.1, 0.0, (n_layers, k // g, n)).astype(np.float16)
    w = lay.pack_fields(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(zero))
    x = _bf(rng, m, k)
    gw = jnp.asarray(1 + 0.3 * rng.standard_normal((n_layers, k)).astype(np.float32)).astype(jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 200_000, m), jnp.int32)
    slots = jnp.asarray(rng.permutation(ring)[:m], jnp.int32)
    inv = jnp.asarray(1.0 / theta ** (np.arange(0, dh, 2) / dh), jnp.float32)
    rope = mg.rope_table(pos, inv)
    qb, kr, vr = _bf(rng, b, hkv, dh, cn), _bf(rng, n_layers, b, hkv, ring, dh), _bf(rng, n_layers, b, hkv, ring, dh)
    layer = int(rng.integers(0, n_layers))
    if unit:
        gw = jnp.ones_like(gw)
    if dense:  # the bf16 kernel on the same values; no norm
        f = jax.jit(lambda x, w, gw, l, rope, slots, qb, kr, vr: mg.bf16_qkv_cache_mgpu(
            x, lay.dequantize_bf16(w), layer=l, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr))
    else:
        f = jax.jit(lambda x, w, gw, l, rope, slots, qb, kr, vr: mg.int4_qkv_cache_mgpu(
            x, w, layer=l, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr,
            norm_weight=None if unit else gw, unit_norm=unit))
    got = [np.asarray(a, np.float32) for a in f(x, w, gw, jnp.int32(layer), rope, slots, qb, kr, vr)]
    again = [np.asarray(a, np.float32) for a in f(x, w, gw, jnp.int32(layer), rope, slots, qb, kr, vr)]
    wf = lay.dequantize_bf16(jax.tree.map(lambda a: a[layer], w)).astype(jnp.float32)
    g_ref = None if dense else gw[layer]
    want = mg.qkv_cache_reference(x, wf, layer=layer, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr,
                                  norm_weight=g_ref)
    # where the reference writes: the elements it turns from NaN into numbers (not where its value differs from
    # the buffer's: at batch 32 a few random bf16 values equal the one they replace)
    nan = [jnp.full_like(a, jnp.nan) for a in (qb, kr, vr)]
    marks = mg.qkv_cache_reference(x, wf, layer=layer, rope=rope, slots=slots, q_buf=nan[0], k_ring=nan[1],
                                   v_ring=nan[2], norm_weight=g_ref)
    ok = True
    for name, a, a2, r, orig, mark in zip(("q_buf", "k_ring", "v_ring"), got, again, want, (qb, kr, vr), marks):
        r, orig = np.asarray(r, np.float32), np.asarray(orig, np.float32)
        written = ~np.isnan(np.asarray(mark, np.float32))
        err = float(np.abs(a - r)[written].max()) if written.any() else 0.0
        good = (np.array_equal(a[~written], orig[~written]) and np.array_equal(a, a2)
                and bool((np.abs(a - r) <= BF16_STEP * np.abs(r) + SUM_ORDER * np.abs(r).max()).all()))
        ok &= good
        what = f"{shape}{' unit norm' if unit else ''}{' bf16' if dense else ''}{f' T={tokens}' if tokens > 1 else ''}"
        print(f"  {'OK  ' if good else 'FAIL'} kernel {what} B={b} layer {layer} {name}: "
              f"{int(written.sum())} written, "
              f"max err {err:.3g}, max |ref| {float(np.abs(r).max()):.3g}, deterministic {np.array_equal(a, a2)}",
              flush=True)
    return ok


def check_model(b: int, n_layers: int, shape: str = "8b", target_t: int = 0, dense: bool = False) -> bool:
    """The draft's decode step with the fused kernel and without; `target_t` > 0: instead the bf16 target's
    verify-shaped pass of that many tokens per row (the target view) with QSPEC_TARGET_QKV_CACHE=1 and 0, over a
    QuantSpecCache, or with `dense` over a dense cache (the AR-bf16 baseline's; the Triton dense kernel)."""
    from qspec_jax import linear as qlinear
    from qspec_jax import model as M
    from qspec_jax.bench import synthetic
    from qspec_jax.bench.e2e import LLAMA31_8B
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    hq, hkv, dh, k, theta = SHAPES[shape]
    cfg = LLAMA31_8B.replace(num_layers=n_layers, vocab_size=4096)
    if shape != "8b":
        cfg = cfg.replace(hidden_size=k, intermediate_size=1536, num_heads=hq, num_kv_heads=hkv, head_dim=dh,
                          rope_theta=theta, rope_scaling=None)
    params = M.init_random_params(cfg, jax.random.PRNGKey(0))
    if dense:
        cache = synthetic.random_dense_cache(cfg, b, 4096, jax.random.PRNGKey(1), extra_slots=64,
                                             lengths=4096 - 7 * jnp.arange(b, dtype=jnp.int32))
    else:
        cache = synthetic.random_quant_cache(cfg, b, 4096, jax.random.PRNGKey(1), group=128, gamma_max=8, fp_start=5)
    t = max(target_t, 1)
    toks = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) + 7
    if target_t:
        env, model, view = qlinear.TARGET_QKV_CACHE_ENV, M.for_device(params), "target"
    else:
        draft = M.for_device(make_draft_params(params, DraftWeightsConfig(group_size=32, method="minmax")))
        env, model, view = qlinear.QKV_CACHE_ENV, draft, "draft"
    out = {}
    for flag in ("all", "0"):
        os.environ[env] = "1" if (target_t and flag == "all") else flag
        logits, c = jax.jit(lambda p, c: M.decode(p, toks, c, view=view))(model, cache)  # weights as arguments
        out[flag] = (np.asarray(logits, np.float32), *(np.asarray(a, np.float32) for a in c.append_buffers))
        jax.clear_caches()
    os.environ.pop(env)
    slots = np.asarray(cache.append_slots(t)).reshape(-1)
    rows = np.repeat(np.arange(b), t)
    if target_t:
        shape = f"{shape} target{' dense cache' if dense else ''} T={t}"
    ok = True
    rel = lambda a, r: float(np.linalg.norm(a - r) / np.linalg.norm(r))  # noqa: E731
    lrel = rel(out["all"][0], out["0"][0])
    agree = float((out["all"][0].argmax(-1) == out["0"][0].argmax(-1)).mean())
    good = lrel < 2e-2
    print(f"  {'OK  ' if good else 'FAIL'} model {shape} B={b}: logits rel {lrel:.2e}, "
          f"argmax agree {agree:.2f}", flush=True)
    ok &= good
    for i, name in ((1, "k"), (2, "v")):
        a, r = out["all"][i], out["0"][i]
        keep = np.ones(a.shape, bool)
        keep[:, rows, :, slots] = False
        srel = rel(a[:, rows, :, slots], r[:, rows, :, slots])
        good = np.array_equal(a[keep], r[keep]) and srel < 2e-2
        ok &= good
        print(f"  {'OK  ' if good else 'FAIL'} model {shape} B={b} {name}: new slots rel {srel:.2e}, others bitwise "
              f"{np.array_equal(a[keep], r[keep])}", flush=True)
    return ok


# The 8B's bf16 linears (K, N) `--parts sweep --sweep-linears` times: q|k|v with the qkv epilogue, the others plain.
BF16_LINEARS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def sweep_bf16(tokens: int, n_layers: int, budget_s: float, linear: str = "qkv") -> None:
    """The bf16 kernel's launch shapes at one of the 8B's linears (B 1, `tokens` rows): q|k|v with
    the qkv epilogue, the others plain (`bf16_matmul_mgpu`, the sum in the cluster), each timed by
    its kernels' GPU time in a profiler trace (not the loop's wall), with cuBLAS's GEMM beside it."""
    import dataclasses
    import itertools
    import tempfile
    import time

    from qspec_jax.bench.timing import time_loop

    rng = np.random.default_rng(8)
    hq, hkv, dh, _, theta = SHAPES["8b"]
    (k, n), m, ring = BF16_LINEARS[linear], tokens, 4608
    cn = 16 * -(-tokens * (hq // hkv) // 16)
    w = _bf(rng, n_layers, k, n)
    inv = jnp.asarray(1.0 / theta ** (np.arange(0, dh, 2) / dh), jnp.float32)
    rope = mg.rope_table(jnp.arange(m, dtype=jnp.int32) + 4000, inv)
    slots = jnp.pad(jnp.arange(m, dtype=jnp.int32) + 4000, (0, mg.qkv_rows(m, dh) - m))
    bufs = (_bf(rng, 1, hkv, dh, cn), _bf(rng, n_layers, 1, hkv, ring, dh), _bf(rng, n_layers, 1, hkv, ring, dh))
    x = _bf(rng, m, k)

    def kernel_us(step):
        with tempfile.TemporaryDirectory() as d:
            r = time_loop(step, (jnp.int32(0), x, bufs), reps=64, trials=1, data=w, trace_dir=d)
        return {name: us for name, us in r["kernels"].items() if us > 0.5}

    def xla(c, d):
        i, x, bufs = c
        y = jnp.dot(x, jax.lax.dynamic_index_in_dim(d, i % n_layers, keepdims=False))
        return i + 1, x + y[0, 0], bufs

    tag = f"{linear} M={m}"
    print(f"  sweep {tag} cuBLAS: {kernel_us(xla)}", flush=True)
    if linear == "qkv":
        geo = mg.QkvCache(num_heads=hq, num_kv_heads=hkv, batch=1, ring=ring, q_cols=cn, layers=n_layers,
                          head_dim=dh, tokens=m)
        default = mg.default_config(k, n, None, reduce=mg.reduce_mode(m, False), epilogue=mg.Epilogue(qkv=geo))
        shapes = list(itertools.product((2,), (128, 256), (4, 2, 8), (4, 6)))
    else:
        default = mg.default_config(k, n, None, reduce=mg.reduce_mode(m, False))
        shapes = list(itertools.product((1, 2), (128, 256), (1, 2, 4, 8), (4, 6)))
    print(f"  sweep {tag} default {default}", flush=True)
    shapes = [(default.wgs, default.k_tile, default.splits, default.stages)] + shapes
    t0, results = time.time(), []
    for wgs, kt, sp, st in shapes:
        if time.time() - t0 > budget_s:
            break
        cfg = dataclasses.replace(default, wgs=wgs, k_tile=kt, splits=sp, stages=st, reduce="cluster")

        def step(c, d, cfg=cfg):
            i, x, bufs = c
            if linear != "qkv":
                return i + 1, x + mg.bf16_matmul_mgpu(x, d, layer=i % n_layers, config=cfg)[0, 0], bufs
            out = mg.bf16_qkv_cache_mgpu(x, d, layer=i % n_layers, rope=rope, slots=slots, q_buf=bufs[0],
                                         k_ring=bufs[1], v_ring=bufs[2], config=cfg)
            return i + 1, x + out[0][0, 0, 0, 0], out
        try:
            ks = kernel_us(step)
        except Exception as e:  # a launch shape the kernel refuses or that does not lower
            print(f"  sweep {tag} wgs{wgs} k{kt} s{sp} st{st}: {type(e).__name__} {str(e)[:80]}", flush=True)
            continue
        us = sum(v for name, v in ks.items() if "mosaic" in name)
        results.append((us, wgs, kt, sp, st))
        print(f"  sweep {tag} wgs{wgs} k{kt} s{sp} st{st}: {us:.2f} us", flush=True)
    for us, wgs, kt, sp, st in sorted(results)[:5]:
        print(f"  best {tag}: wgs{wgs} k{kt} s{sp} st{st} cluster {us:.2f} us "
              f"(floor {k * n * 2 / 4.35e12 * 1e6:.1f})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,3,8,24")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--parts", default="kernel,model")
    ap.add_argument("--model-batches", default="1,8")
    ap.add_argument("--shapes", default="8b,smollm2", help=f"head shapes, of {sorted(SHAPES)}")
    ap.add_argument("--tokens", default="1", help="tokens per batch row of the kernel checks (comma list)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per linear and token count of --parts sweep")
    ap.add_argument("--sweep-linears", default="qkv", help=f"--parts sweep: of {sorted(BF16_LINEARS)}")
    ap.add_argument("--target-t", type=int, default=0, help="the model part checks the bf16 target's pass of this "
                                                             "many tokens per row instead of the draft's step")
    ap.add_argument("--dense", action="store_true", help="with --target-t: over a dense cache (AR-bf16's)")
    ap.add_argument("--kinds", default="int4", help="int4 (the draft's kernel, with and without norm weight) and / "
                                                    "or bf16 (`bf16_qkv_cache_mgpu`)")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if bad := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes {','.join(bad)}: expected names of {sorted(SHAPES)}")
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    ok = True
    for shape in shapes:
        if "kernel" in args.parts:
            for i, b in enumerate(int(v) for v in args.batches.split(",")):
                for t in (int(v) for v in args.tokens.split(",")):
                    if "int4" in args.kinds:
                        ok &= check_kernel(b, args.layers, seed=100 + i, shape=shape, tokens=t)
                        ok &= check_kernel(b, args.layers, seed=200 + i, shape=shape, unit=True, tokens=t)
                    if "bf16" in args.kinds:
                        ok &= check_kernel(b, args.layers, seed=300 + i, shape=shape, tokens=t, dense=True)
        if "sweep" in args.parts and shape == "8b":
            for lin in args.sweep_linears.split(","):
                for t in (int(v) for v in args.tokens.split(",")):
                    sweep_bf16(t, max(args.layers, 8), args.budget, lin)
        if "model" in args.parts:
            for b in (int(v) for v in args.model_batches.split(",")):
                ok &= check_model(b, args.layers, shape, args.target_t, args.dense)
    print("ALL OK" if ok else "FAILURES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
