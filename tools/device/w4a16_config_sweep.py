"""Launch-shape sweep of the Mosaic GPU INT4 skinny GEMM (pallas_kernels/linear/mosaic_gpu.py) on the
8B and SmolLM2 drafts' shapes, to replace `default_config`'s cost model by measured choices. Not in CI.

    PYTHONPATH=. python3 tools/device/w4a16_config_sweep.py [--m 1] [--group 32] [--budget 240] > sweep.log
    PYTHONPATH=. python3 tools/device/w4a16_config_sweep.py --shapes s_qkv,s_o,s_gate_up,s_down --m 32 --stages 4,6,9

For each shape and each valid MgpuConfig (warpgroups, k tile, splits, reduction, pipeline depth)
it times the kernel in an in-device loop over enough weight copies to defeat the 60 MB L2 (each
call chained after the previous one by an optimization barrier, as in `qspec-bench w4a16`),
checks the output of the fastest config against the default config's (same K order in both:
every split-K sum is p[0] + p[1] + ..., so equal configs of equal splits agree bitwise and
others within float32 rounding), and prints one table per shape plus a JSON line of the best.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402

# The 8B draft's shapes (the default) and SmolLM2-135M's (K = 576: k_tile 64 only), as `qspec-bench w4a16` names them.
from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402
from qspec_jax.bench.w4a16 import BENCH_SHAPES as SHAPES, LLAMA31_8B_FUSED  # noqa: E402

L2_DEFEAT = 240 << 20


def weights(key, k, n, g, copies):
    out = []
    for c in range(copies):
        kc = jax.random.fold_in(key, c)
        packed = jax.random.bits(kc, (k // 2, n), jnp.uint8)
        scale = jax.random.uniform(jax.random.fold_in(kc, 1), (k // g, n), jnp.float32, 0.005, 0.02).astype(jnp.float16)
        zero = jax.random.uniform(jax.random.fold_in(kc, 2), (k // g, n), jnp.float32, -0.1, 0.0).astype(jnp.float16)
        out.append(lay.pack_fields(packed, scale, zero))
    return out


def time_config(cfg, x, ws, iters, trials=5):
    return time_chained(lambda xi, w: mg.int4_matmul_mgpu(xi, w, config=cfg), x, ws, iters, trials)


def time_chained(op, x, ws, iters, trials=5):
    """Median seconds per call of op(x, w) over the weight copies `ws` (W4A16Packed or [K, N] arrays), each call
    ordered after the previous one by an optimization barrier, `iters` rounds in one jitted loop; and the first
    copy's output."""
    def f(x, ws):
        def body(i, carry):
            xc, ys = carry
            ws_i, _ = lax.optimization_barrier((ws, i))
            prev, out = None, []
            for w in ws_i:
                xi = xc
                if prev is not None:
                    xi, _ = lax.optimization_barrier((xc, prev))
                prev = op(xi, w)
                out.append(prev)
            return lax.optimization_barrier((xc, tuple(out)))
        y0 = tuple(jnp.zeros((x.shape[0], w.n if isinstance(w, lay.W4A16Packed) else w.shape[1]), jnp.bfloat16)
                   for w in ws)
        return lax.fori_loop(0, iters, body, (x, y0))[1]

    exe = jax.jit(f).lower(x, ws).compile()
    ys = exe(x, ws)
    jax.block_until_ready(ys)
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(x, ws))
        ts.append((time.perf_counter() - t0) / (iters * len(ws)))
    return statistics.median(ts), ys[0]


def configs(k, n, g, stage_counts=(4, 6), k_tiles=(256, 128, 64), splits=(1, 2, 3, 4, 6, 8, 9, 12, 16),
            reduces=("cluster", "gmem", "sem"), wgs_values=(2, 1), k_groups=(1,)):
    """Every valid launch shape; pipeline depths from `stage_counts`, each at most a CTA's k steps
    (deeper only adds empty buffers), the smallest always; warpgroups per CTA, k tiles, split counts,
    split-K sums (for S > 1) and k groups (`MgpuConfig.k_groups`) restricted to the given ones."""
    c = lay.chunk_cols(g)
    for wgs in wgs_values:
        if n % (lay.ROWS * wgs):
            continue
        for kt in k_tiles:
            if kt % c or k % kt:
                continue
            steps = k // kt
            for s in splits:
                if steps % s or (s > 1 and steps // s < 2):
                    continue
                allowed = [r for r in ("cluster", "gmem", "sem") if r != "cluster" or s <= mg.MAX_CLUSTER]
                for reduce in ([r for r in allowed if r in reduces] if s > 1 else ["gmem"]):
                    for kg in k_groups:
                        if (steps // s) % kg:
                            continue
                        for stages in sorted(set(stage_counts)):
                            if stages > steps // s and stages != min(stage_counts):
                                continue
                            yield mg.MgpuConfig(wgs=wgs, k_tile=kt, splits=s, reduce=reduce, stages=stages,
                                                tma_view="wide", k_groups=kg)


def ints(csv: str) -> tuple[int, ...]:
    return tuple(int(v) for v in csv.split(","))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(LLAMA31_8B_FUSED),
                    help="qspec-bench w4a16 shape names, or KxN for any other (e.g. 4096x33792: gate_up's K at 264 "
                         "CTAs of two row tiles, one equal wave of two per SM)")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--stages", default="4,6",
                    help="pipeline depths swept (comma-separated; e.g. 4,6,9 for SmolLM2's 9-step K = 576)")
    ap.add_argument("--k-tiles", default="256,128,64", help="k tiles swept")
    ap.add_argument("--splits", default="1,2,3,4,6,8,9,12,16", help="split-K factors swept")
    ap.add_argument("--reduces", default="cluster,gmem,sem", help="split-K sums swept (S > 1)")
    ap.add_argument("--wgs", default="2,1", help="warpgroups (64-row tiles) per CTA swept")
    ap.add_argument("--k-groups", default="1", help="k groups per row tile swept (MgpuConfig.k_groups)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="time only the default config, with and without programmatic dependent launch")
    ap.add_argument("--default-only", action="store_true", help="time only the default config (e.g. under ncu)")
    ap.add_argument("--diags", default="",
                    help="time only the default config and its MgpuConfig.diag variants (e.g. stream,prmt; wrong "
                         "results, timing only: their rel column is against the real kernel)")
    args = ap.parse_args(argv)
    stage_counts = tuple(int(v) for v in args.stages.split(","))
    t_start = time.perf_counter()
    key = jax.random.PRNGKey(0)
    best_all = {}
    for name in args.shapes.split(","):
        if name in SHAPES:
            k, n = SHAPES[name]
        else:
            try:
                k, n = (int(v) for v in name.split("x"))
            except ValueError:
                ap.error(f"--shapes: {name!r} is neither a shape name ({', '.join(SHAPES)}) nor KxN")
        g = args.group
        nbytes = lay.packed_bytes(k, n, g)
        copies = max(1, min(8, -(-L2_DEFEAT // nbytes)))
        ws = weights(key, k, n, g, copies)
        x = jax.random.normal(jax.random.fold_in(key, 99), (args.m, k), jnp.float32).astype(jnp.bfloat16)
        iters = max(2, int(2e-3 / (nbytes / 3e12) / copies))
        default = mg.default_config(k, n, g, reduce=mg.reduce_mode(args.m, False))
        rows = []
        ref = None
        candidates = ([default] if args.default_only
                      else [default, default.replace(pdl=not default.pdl)] if args.pdl_ab
                      else [default, *[default.replace(diag=d) for d in args.diags.split(",")]] if args.diags
                      else [default, *[c for c in configs(k, n, g, stage_counts, ints(args.k_tiles), ints(args.splits),
                                                           tuple(args.reduces.split(",")), ints(args.wgs),
                                                           ints(args.k_groups)) if c != default]])
        for cfg in candidates:
            if time.perf_counter() - t_start > args.budget:
                print(f"  budget reached; {name} partially swept", flush=True)
                break
            try:
                sec, y = time_config(cfg, x, ws, iters)
            except Exception as e:  # noqa: BLE001 - an invalid launch is a result of the sweep
                print(f"  {name} {cfg} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            if ref is None:
                ref = y.astype(jnp.float32)
            err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            rows.append((sec * 1e6, cfg, err))
            print(f"  {name:8s} {sec * 1e6:8.2f} us {nbytes / sec / 1e12:5.2f} TB/s  rel {err:.1e}  "
                  f"wgs{cfg.wgs} kt{cfg.k_tile} S{cfg.splits} {cfg.reduce} st{cfg.stages} kg{cfg.k_groups} pdl={cfg.pdl}"
                  f"{f' diag={cfg.diag}' if cfg.diag else ''}"
                  f"{'  (default)' if cfg == default else ''}", flush=True)
        if not rows:
            continue
        rows.sort(key=lambda r: r[0])
        us, cfg, err = rows[0]
        d_us = next(r[0] for r in rows if r[1] == default) if any(r[1] == default for r in rows) else float("nan")
        floor_us = nbytes / read_ceiling_bps() * 1e6
        best_all[name] = {"k": k, "n": n, "g": g, "m": args.m, "best_us": us, "default_us": d_us,
                          "floor_us": floor_us, "rel_err_vs_default": err,
                          "best": {"wgs": cfg.wgs, "k_tile": cfg.k_tile, "splits": cfg.splits,
                                   "reduce": cfg.reduce, "stages": cfg.stages, "k_groups": cfg.k_groups,
                                   "pdl": cfg.pdl}}
        print(f"== {name}: best {us:.2f} us (default {d_us:.2f}, floor {floor_us:.2f}) {cfg}", flush=True)
    print("BEST " + json.dumps(best_all), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
