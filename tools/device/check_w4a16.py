"""GPU check of the Hopper skinny GEMMs (pallas_kernels/linear/mosaic_gpu.py), then timing. Not in CI.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 PYTHONPATH=. python3 tools/device/check_w4a16.py --out $OUT

1. correctness on fresh random inputs at the benchmark shapes: every kernel (Mosaic INT4 with both
   split-K reductions, Mosaic bf16) against the float32 oracle (x @ (U s + z)) and against the same
   product with the kernel's own bf16 weight (tight), on a poisoned output (a freed NaN buffer);
2. the "gmem" and "cluster" split-K sums give the same bits (same order p[0] + p[1] + ...);
3. row invariance, bitwise: row i of an M-row call == the row computed alone, == itself with the
   other rows replaced, for M = 5, 8, 16, 24;
3b. the fused kernels of issue 32 (`check_fused`: the draft layer's qkv + norm, o + residual,
   gate_up + norm + SiLU·up, down + residual) against `epilogue_reference` / bitwise against
   unfused + residual, their row invariance, and (`time_fused`) their time against the unfused
   kernel plus the XLA glue they replace;
4. SASS of one INT4 and one bf16 kernel (MOSAIC_GPU_DUMP_SASS in a subprocess, tarred to $OUT);
5. timing through `qspec_jax.bench.w4a16.run` (in-device loops over rotating weights) for the
   shapes / M / G / implementations given, within --budget seconds.
Prints a short table last; writes check_w4a16.json (and bench JSON) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time

sys.path.insert(0, os.getcwd())
if "--cpu-dry-run" in sys.argv:  # before JAX starts: the interpreter's barrier callbacks need a thread pool that
    # grows with the host device count, else blocked warpgroups can starve the one that must arrive
    # (a deadlock of the simulation, not of the kernel; tests/helpers/subproc.py run_in_child)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags: cuBLAS GEMMs)
from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench import w4a16 as bench  # noqa: E402
from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402

CHECK_SHAPES = {**bench.LLAMA31_8B_FUSED, **bench.SMOLLM2_FUSED}
DRY = {"interpret": False}  # --cpu-dry-run: the same script logic on the interpret-mode twins


def _int4(x, p, cfg=None, out_dtype=None, kernel="mma"):
    if DRY["interpret"]:
        return mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True, out_dtype=out_dtype)
    return mg.int4_matmul_mgpu(x, p, config=cfg, out_dtype=out_dtype, variant=kernel)


def _bf16(x, w, cfg=None):
    return mg.bf16_matmul_mgpu(x, w, config=cfg, interpret=DRY["interpret"])


def _rel(y, ref) -> float:
    y = jnp.asarray(y, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(y))):
        return float("inf")
    return float(jnp.linalg.norm(y - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def _ref_int4(x, qw, p):
    """(x @ W_f32, x @ W_bf16) with the weights formed on the host CPU backend (XLA:GPU may
    drop a float32 -> bf16 -> float32 rounding as excess precision) and float64 products: W_f32 =
    U * scale + zero from the fields, W_bf16 the kernel's own weight from the layout."""
    cpu = jax.devices("cpu")[0]
    pc = jax.device_put(p, cpu)
    w32 = np.asarray(jax.device_put(qw, cpu).dequantize(), np.float64)
    w16 = np.asarray(lay.dequantize_bf16(pc).astype(jnp.float32), np.float64)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    return jnp.asarray(xf @ w32, jnp.float32), jnp.asarray(xf @ w16, jnp.float32)


@jax.jit
def _ref_bf16(x, w):
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def _int4_weight(key, k, n, g):
    qw = bench._gen_int4(key, k=k, n=n, g=g)
    return qw, lay.pack_quantized(qw)


def check_correctness(shapes, groups, ms, results, log):
    key = jax.random.PRNGKey(1234)
    for name, (k, n) in shapes.items():
        for g in groups:
            if k % max(64, g):
                continue
            key, kw = jax.random.split(key)
            qw, p = _int4_weight(kw, k, n, g)
            cfg = mg.default_config(k, n, g)
            cfgs = [(cfg, "mma")]
            if not DRY["interpret"]:
                cfgs.append((cfg, "wgmma"))
                cfgs.append((cfg.replace(tma_view="wide"), "mma"))
                if cfg.splits > 1:
                    cfgs.append((cfg.replace(reduce="cluster" if cfg.reduce == "gmem" else "gmem"), "mma"))
            for m in ms:
                key, kx = jax.random.split(key)
                x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
                ref32, ref16 = _ref_int4(x, qw, p)
                outs = []
                for c, kern in cfgs:
                    t0 = time.perf_counter()
                    try:
                        f = jax.jit(lambda x, p, c=c, kern=kern: _int4(x, p, c, jnp.float32, kern))
                        y = bench.poison_then(lambda: f(x, p), (m, n), jnp.float32)
                        e32, e16 = _rel(y, ref32), _rel(y, ref16)
                        ok = e32 <= bench.TOL_BF16 and e16 <= 1e-4  # float32 out: only the sum order
                        outs.append(np.asarray(y))
                        status = "ok" if ok else "FAIL"
                    except Exception as e:  # noqa: BLE001
                        e32 = e16 = float("nan")
                        status = f"ERROR {type(e).__name__}: {str(e)[:300]}"
                    results.append(dict(check="int4", shape=name, K=k, N=n, G=g, M=m, config=str(c), kernel=kern,
                                        rel_f32=e32, rel_bf16w=e16, status=status,
                                        s=time.perf_counter() - t0))
                    log(f"int4 {name:9s} G={g:3d} M={m:2d} {bench._mosaic_name(c, kern):30s} rel_f32={e32:.2e} "
                        f"rel_bf16w={e16:.2e} {status} ({time.perf_counter() - t0:.1f} s)")
                if len(outs) == 4:  # the two reductions sum the same partials in the same order
                    same = bool(np.array_equal(outs[0].view(np.uint32), outs[3].view(np.uint32)))
                    results.append(dict(check="gmem==cluster", shape=name, G=g, M=m, status="ok" if same else "FAIL"))
                    log(f"     gmem == cluster bitwise: {same}")
        # bf16 kernel (no group)
        key, kw, kx = jax.random.split(key, 3)
        w = bench._gen_bf16(kw, k=k, n=n)
        cfg = mg.default_config(k, n, None)
        for m in ms[:1]:
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = _ref_bf16(x, w)
            t0 = time.perf_counter()
            try:
                f = jax.jit(lambda x, w: _bf16(x, w, cfg))
                y = bench.poison_then(lambda: f(x, w), (m, n), jnp.bfloat16)
                e = _rel(y, ref)
                status = "ok" if e <= 5e-3 else "FAIL"
            except Exception as ex:  # noqa: BLE001
                e, status = float("nan"), f"ERROR {type(ex).__name__}: {str(ex)[:300]}"
            results.append(dict(check="bf16", shape=name, K=k, N=n, M=m, config=str(cfg), rel_f32=e,
                                status=status))
            log(f"bf16 {name:9s}       M={m:2d} {bench._mosaic_name(cfg):24s} rel_f32={e:.2e} {status}")


def check_row_invariance(results, log, ms=(5, 8, 16, 24), cases=None):
    """Row i of an M-row call == the row alone (bitwise), and independent of the other rows."""
    key = jax.random.PRNGKey(77)
    cases = cases or [("int4", "o", 4096, 4096, 32), ("int4", "qkv", 4096, 6144, 128),
                      ("bf16", "o", 4096, 4096, None), ("bf16", "down", 14336, 4096, None)]
    for kind, name, k, n, g in cases:
        key, kw = jax.random.split(key)
        if kind == "int4":
            _, p = _int4_weight(kw, k, n, g)
            f = jax.jit(lambda x, p=p: _int4(x, p))
        else:
            w = bench._gen_bf16(kw, k=k, n=n)
            f = jax.jit(lambda x, w=w: _bf16(x, w))
        bad = 0
        try:
            for m in ms:
                key, kx, ko = jax.random.split(key, 3)
                x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
                y = np.asarray(f(x)).view(np.uint16)
                x2 = x.at[1:].set(jax.random.normal(ko, (m - 1, k), jnp.float32).astype(jnp.bfloat16))
                y2 = np.asarray(f(x2)).view(np.uint16)
                bad += int(not np.array_equal(y[0], y2[0]))
                for i in range(m):
                    yi = np.asarray(f(x[i:i + 1])).view(np.uint16)[0]
                    bad += int(not np.array_equal(y[i], yi))
            status = "ok" if bad == 0 else f"FAIL ({bad} rows differ)"
        except Exception as e:  # noqa: BLE001
            status = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        results.append(dict(check="row_invariance", kind=kind, shape=name, G=g, Ms=list(ms), status=status))
        log(f"row invariance {kind} {name} G={g} M={ms}: {status}")


def time_diagnostics(results, log, cases=(("gate_up", 4096, 28672, 32), ("o", 4096, 4096, 32))):
    """Times the "mma" kernel with parts of its stage work removed (timing only; the outputs are
    wrong by design): where the time goes."""
    key = jax.random.PRNGKey(5)
    for name, k, n, g in cases:
        key, kw, kx = jax.random.split(key, 3)
        nbytes = lay.packed_bytes(k, n, g) + 2 * (k + n)
        c = bench._copies(nbytes)
        u = max(c, 4)
        ws = tuple(lay.pack_quantized(bench._gen_int4(kk, k=k, n=n, g=g)) for kk in jax.random.split(kw, c))
        xs = bench._gen_x(kx, m=1, k=k, u=u, dtype=jnp.bfloat16)
        base = mg.default_config(k, n, g)
        extra = [base.replace(tma_view="wide")]  # the diagnosed fix: stream and full
        extra += [base.replace(tma_view="wide", diag="stream")]
        for diag, cfg in [*((d, base.replace(diag=d)) for d in mg.DIAGNOSTICS),
                          *((f"wide{'-' + c.diag if c.diag else ''}", c) for c in extra)]:
            op = lambda x, p, cfg=cfg: mg.int4_matmul_mgpu(x, p, config=cfg)  # noqa: E731
            try:
                iters = bench._iters_for(nbytes / 2.0e12 + 3e-6, u, 5e-3, False)
                _, per_op, _ = bench._time_loop(op, xs, ws, (1, n), jnp.bfloat16, iters=iters, trials=5, calls=2)
                t = float(np.median(per_op))
                status = "ok"
            except Exception as e:  # noqa: BLE001
                t, status = float("nan"), f"ERROR {type(e).__name__}: {str(e)[:200]}"
            results.append(dict(check="diag", shape=name, G=g, M=1, config=str(cfg), diag=diag or "full",
                                us=t * 1e6, tb_s=nbytes / t / 1e12, status=status))
            log(f"diag {name:8s} G={g} M=1 {bench._mosaic_name(cfg):22s} {diag or 'full':8s} "
                f"{t * 1e6:8.2f} us  {nbytes / t / 1e12:5.2f} TB/s  {status}")


FUSED_CASES = (  # (shape, K, N, epilogue): the 8B draft layer's four linears, as the model fuses them
    ("qkv", 4096, 6144, mg.Epilogue(norm=True)),
    ("o", 4096, 4096, mg.Epilogue(residual=True)),
    ("gate_up", 4096, 28672, mg.Epilogue(norm=True, swiglu=True)),
    ("down", 14336, 4096, mg.Epilogue(residual=True)),
)
SMOL_FUSED_CASES = tuple(  # SmolLM2-135M's draft layer (batch 32 needs M_pad 32: the wide exchange)
    (name, *bench.SMOLLM2_FUSED[name], epi) for name, epi in (
        ("s_qkv", mg.Epilogue(norm=True)), ("s_o", mg.Epilogue(residual=True)),
        ("s_gate_up", mg.Epilogue(norm=True, swiglu=True)), ("s_down", mg.Epilogue(residual=True))))


def _fused_inputs(key, k, n, m, g=32):
    kw, kx, kg, kr = jax.random.split(key, 4)
    _, p = _int4_weight(kw, k, n, g)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    gw = (1.0 + 0.3 * jax.random.normal(kg, (k,), jnp.float32)).astype(jnp.bfloat16)
    res = jax.random.normal(kr, (m, n), jnp.float32).astype(jnp.bfloat16)
    return p, x, gw, res


def _fused(x, p, epi, gw, res, out_dtype=None, kernel="mma", cfg=None):
    kw = dict(norm_weight=gw if epi.norm else None, swiglu=epi.swiglu, residual=res if epi.residual else None)
    if DRY["interpret"]:
        return mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True, out_dtype=out_dtype, **kw)
    return mg.int4_matmul_mgpu(x, p, config=cfg, variant=kernel, out_dtype=out_dtype, **kw)


def _fused_ref(x, p, epi, gw, res, out_dtype):
    """`epilogue_reference` on the host CPU with the kernel's own bf16 weight."""
    cpu = jax.devices("cpu")[0]
    args = jax.device_put((x, p, gw, res), cpu)
    with jax.default_device(cpu):
        w16 = lay.dequantize_bf16(args[1]).astype(jnp.float32)
        return np.asarray(mg.epilogue_reference(args[0], w16, epi, norm_weight=args[2], residual=args[3],
                                                out_dtype=out_dtype))


def check_bf16_swiglu(results, log, shapes=(("gate_up", 4096, 28672),), ms=(1, 5, 16, 24), layers=2):
    """The bf16 kernel's SiLU·up (the target's gate | up weight, a stack read at layer 1) at its
    launch shape on this device (`default_config`: the tuned one where there is one), fresh
    random inputs, a poisoned output: float32 outputs against `epilogue_reference` on the host
    CPU (only the float32 summation order and exp differ), bit for bit against a second call, and
    row invariance (each row of the M-row call == the row alone, bf16 outputs)."""
    key = jax.random.PRNGKey(4242)
    cpu = jax.devices("cpu")[0]
    for name, k, n in shapes:
        key, kw, kx = jax.random.split(key, 3)
        w = (jax.random.normal(kw, (layers, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        cfg = mg.default_config(k, n, None, epilogue=mg.Epilogue(swiglu=True))
        with jax.default_device(cpu):
            w1 = jax.device_put(w[1], cpu).astype(jnp.float32)
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.float32).astype(jnp.bfloat16)
            f32 = jax.jit(lambda x, w: _bf16_swiglu(x, w, cfg, jnp.float32))
            try:
                y = bench.poison_then(lambda: f32(x, w), (m, n // 2), jnp.float32)
                y2 = np.asarray(f32(x, w))
                with jax.default_device(cpu):
                    ref = np.asarray(mg.epilogue_reference(jax.device_put(x, cpu), w1, mg.Epilogue(swiglu=True),
                                                           out_dtype=jnp.float32))
                e = _rel(y, ref)
                same = bool(np.array_equal(np.asarray(y).view(np.uint32), y2.view(np.uint32)))
                b16 = jax.jit(lambda x, w: _bf16_swiglu(x, w, cfg, jnp.bfloat16))
                yb = np.asarray(b16(x, w).astype(jnp.float32))
                rows = all(np.array_equal(yb[i], np.asarray(b16(x[i:i + 1], w).astype(jnp.float32))[0])
                           for i in {0, m - 1})
                status = "ok" if e <= 1e-4 and same and rows else "FAIL"
            except Exception as ex:  # noqa: BLE001
                e, same, rows, status = float("nan"), False, False, f"ERROR {type(ex).__name__}: {str(ex)[:300]}"
            results.append(dict(check="bf16_swiglu", shape=name, K=k, N=n, M=m, config=str(cfg), rel_f32=e,
                                deterministic=same, rows=rows, status=status))
            log(f"bf16 swiglu {name:9s} M={m:2d} {bench._mosaic_name(cfg):24s} rel_f32={e:.2e} deterministic "
                f"{same} rows {rows} {status}")


def _bf16_swiglu(x, w, cfg, out_dtype):
    return mg.bf16_matmul_mgpu(x, w, layer=1, config=cfg, out_dtype=out_dtype, swiglu=True,
                               interpret=DRY["interpret"])


def check_fused(results, log, cases=FUSED_CASES, ms=(1, 16), kernels=("mma", "wgmma")):
    """The fused kernels (issue 32) on fresh random inputs, poisoned outputs:
    norm / swiglu with float32 outputs against `epilogue_reference` on the CPU (the kernel's bf16
    weight; only the float32 summation order differs: <= 1e-4) and bit for bit against a second
    identical call (a race between threads would differ); the residual ones bit for bit
    against the same kernel unfused plus the residual in XLA; then bitwise row invariance
    (row i of an M-row call == the row alone)."""
    key = jax.random.PRNGKey(3232)
    for name, k, n, epi in cases:
        n_out = n // 2 if epi.swiglu else n
        for m in ms:
            key, kk = jax.random.split(key)
            p, x, gw, res = _fused_inputs(kk, k, n, m)
            for kern in kernels[:1] if (DRY["interpret"] or m != ms[0]) else kernels:  # wgmma at the first M
                t0 = time.perf_counter()
                print(f"  ... fused {name}{epi.tag()} M={m} {kern}", flush=True)  # the last line if it hangs
                try:
                    if epi.residual:
                        f = jax.jit(lambda x, p, gw, res, kern=kern, epi=epi: _fused(x, p, epi, gw, res, kernel=kern))
                        y = np.asarray(bench.poison_then(lambda: f(x, p, gw, res), (m, n_out), jnp.bfloat16))
                        plain = jax.jit(lambda x, p, res, kern=kern: _int4(x, p, kernel=kern) + res)(x, p, res)
                        bad = int((y.view(np.uint16) != np.asarray(plain).view(np.uint16)).sum())
                        err = _rel(y, _fused_ref(x, p, epi, gw, res, jnp.float32))
                        ok = bad == 0 and err <= bench.TOL_BF16
                        detail = f"bitwise vs unfused+res: {bad} differ, rel_ref={err:.2e}"
                    else:
                        f = jax.jit(lambda x, p, gw, kern=kern, epi=epi: _fused(x, p, epi, gw, None, jnp.float32, kern))
                        y = bench.poison_then(lambda: f(x, p, gw), (m, n_out), jnp.float32)
                        err = _rel(y, _fused_ref(x, p, epi, gw, res, jnp.float32))
                        # a second identical call: a race between the kernel's threads changes bits from
                        # call to call, even where the error against the reference happens to stay small
                        same = np.array_equal(np.asarray(y), np.asarray(f(x, p, gw)))
                        ok = err <= 1e-4 and same
                        detail = f"rel_ref={err:.2e}, deterministic {same}"
                    status = "ok" if ok else "FAIL"
                except Exception as e:  # noqa: BLE001
                    status, detail = f"ERROR {type(e).__name__}: {str(e)[:600]}", ""
                results.append(dict(check="fused", shape=name, epi=epi.tag(), M=m, kernel=kern, status=status,
                                    detail=detail, s=time.perf_counter() - t0))
                log(f"fused {name:8s}{epi.tag():14s} M={m:2d} {kern:5s} {detail} {status} "
                    f"({time.perf_counter() - t0:.1f} s)")
        # row invariance at M = 5 and 16 (the default kernel), and at the first M above 24 asked for
        # (the wide exchange: swizzled [64, M_pad] tiles, row sums broadcast from a vector)
        row_ms = (5, 16) + tuple(m for m in ms if m > mg.PLAIN_EXCHANGE_MP)[:1]
        bad, status = 0, "ok"
        try:
            for m in row_ms:
                key, kk = jax.random.split(key)
                p, x, gw, res = _fused_inputs(kk, k, n, m)
                f = jax.jit(lambda x, res, p=p, gw=gw, epi=epi: _fused(x, p, epi, gw, res))
                y = np.asarray(f(x, res)).view(np.uint16)
                for i in range(m):
                    yi = np.asarray(f(x[i:i + 1], res[i:i + 1])).view(np.uint16)[0]
                    bad += int(not np.array_equal(y[i], yi))
            status = "ok" if bad == 0 else f"FAIL ({bad} rows differ)"
        except Exception as e:  # noqa: BLE001
            status = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        results.append(dict(check="fused_rows", shape=name, epi=epi.tag(), M=list(row_ms), status=status))
        log(f"fused row invariance {name}{epi.tag()} M={','.join(map(str, row_ms))}: {status}")


def time_fused(results, log, cases=FUSED_CASES, budget_s=60.0, m=1):
    """G = 32, M rows (1 by default): each fused kernel against the unfused kernel plus the XLA
    glue it replaces (rms_norm before, silu(gate) * up after, the residual add after), in-device
    loops over rotating weights; the plain kernel; each part of gate_up's epilogue alone (norm,
    SiLU·up) on the same launch shape; where the norm runs in the consumers (SmolLM2's K 576) the
    fused kernel without each of its parts (`mosaic_gpu.NORM_DIAGNOSTICS`: wrong results, timing
    only) and at k_tile 192; at M = 1 also the fused kernel with PDL (back to back), split-K and 8
    stages for qkv and o."""
    key = jax.random.PRNGKey(6)
    t_start = time.perf_counter()
    order = ("gate_up", "down", "qkv", "o")  # the largest overheads first (issue 32 run 1)
    for name, k, n, epi in sorted(cases, key=lambda c: order.index(c[0]) if c[0] in order else len(order)):
        if time.perf_counter() - t_start > budget_s:
            log(f"time_fused: budget spent, skipping {name}")
            break
        key, kw, kx = jax.random.split(key, 3)
        nbytes = lay.packed_bytes(k, n, 32) + 2 * (k + n)
        c = bench._copies(nbytes)
        u = max(c, 4)
        ws = tuple(lay.pack_quantized(bench._gen_int4(kk, k=k, n=n, g=32)) for kk in jax.random.split(kw, c))
        xs = bench._gen_x(kx, m=m, k=k, u=u, dtype=jnp.bfloat16)
        gw = jnp.ones((k,), jnp.bfloat16) * 1.1
        res = jnp.ones((m, n), jnp.bfloat16)

        def unfused(x, p, epi=epi):
            if epi.norm:
                xf = x.astype(jnp.float32)
                x = gw * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)).astype(x.dtype)
            y = mg.int4_matmul_mgpu(x, p)
            if epi.swiglu:
                gate, up = jnp.split(y, 2, axis=-1)
                y = jax.nn.silu(gate) * up
            return y + res if epi.residual else y

        base = mg.default_config(k, n, 32, epilogue=epi)
        # (label, epilogue, launch shape): the fused kernel, its parts alone on the same launch shape
        # (where the fused kernel's time goes), PDL, and for the small shapes more bytes in flight
        # (split-K summed in the cluster, deeper rings)
        runs = [("fused", epi, base), ("plain", mg.Epilogue(), base)]
        if epi.norm and epi.swiglu:
            runs += [("norm_only", mg.Epilogue(norm=True), base), ("swiglu_only", mg.Epilogue(swiglu=True), base)]
        cn = mg.norm_in_consumers(epi, "int4", "mma", False, k, base.splits, base.k_groups)
        if epi.norm and not cn:  # the norm pass further ahead of the consumers (MgpuConfig.norm_ahead)
            runs += [(f"fused_ahead{a}", epi, base.replace(norm_ahead=a)) for a in (2, 3) if a < base.stages]
        if cn:  # the norm in the consumers: each of its parts left out (wrong results), k_tile 192 where it divides K
            runs += [(f"fused_{d}", epi, base.replace(diag=d)) for d in mg.NORM_DIAGNOSTICS]
            runs += [("fused_kt192", epi, base.replace(k_tile=192))] if k % 192 == 0 and base.k_tile != 192 else []
        if m == 1:
            runs.append(("fused_pdl", epi, base.replace(pdl=True)))
        if name in ("qkv", "o") and m == 1:
            runs += [(f"fused_s{sp}", epi, base.replace(splits=sp, reduce="cluster")) for sp in (2, 4)
                     if sp != base.splits]
            runs.append(("fused_st8", epi, base.replace(stages=8)))
        ops = {"unfused+glue": (unfused, n // 2 if epi.swiglu else n)}
        ahead = [(lab, c) for lab, _, c in runs if lab.startswith("fused_ahead")]
        if ahead:  # the lookahead must not change the bits: each against the default, on one input
            one = lambda c: np.asarray(jax.jit(lambda x, p, c=c: _fused(x, p, epi, gw, res, cfg=c))(  # noqa: E731
                xs[0], ws[0])).view(np.uint16)
            y0 = one(base)
            for lab, c in ahead:
                bad = int((one(c) != y0).sum())
                results.append(dict(check="fused_ahead_bits", shape=name, M=m, variant=lab,
                                    status="ok" if bad == 0 else f"FAIL ({bad} differ)"))
                log(f"bits {name:8s}{epi.tag():14s} M={m:2d} {lab}: {bad} elements differ from norm_ahead=1")
        for lab, e, c in runs:
            ops[lab] = ((lambda x, p, c=c, e=e: _fused(x, p, e, gw, res, cfg=c)), n // 2 if e.swiglu else n)
        for label, (op, n_out) in ops.items():
            if time.perf_counter() - t_start > budget_s:
                log(f"time_fused: budget spent, skipping {name} {label}")
                break
            try:
                iters = bench._iters_for(nbytes / 2.0e12 + 3e-6, u, 5e-3, False)
                _, per_op, _ = bench._time_loop(op, xs, ws, (m, n_out), jnp.bfloat16, iters=iters, trials=5,
                                                calls=2)
                t, status = float(np.median(per_op)), "ok"
            except Exception as e:  # noqa: BLE001
                t, status = float("nan"), f"ERROR {type(e).__name__}: {str(e)[:300]}"
            results.append(dict(check="time_fused", shape=name, epi=epi.tag(), M=m, variant=label, us=t * 1e6,
                                floor_us=nbytes / read_ceiling_bps() * 1e6, status=status))
            log(f"time {name:8s}{epi.tag():14s} M={m:2d} {label:13s} {t * 1e6:8.2f} us (floor "
                f"{nbytes / read_ceiling_bps() * 1e6:.2f}) {status}")


def dump_sass(out_dir, log):
    """Compile one INT4 (g32, M=1, o shape) and one bf16 kernel with Mosaic's dump flags in a
    subprocess; tar the dump folder into out_dir/sass_dump.tgz."""
    dump = "/tmp/mosaic_dump"
    os.makedirs(dump, exist_ok=True)
    import glob

    cuda_bins = sorted({os.path.dirname(p) for p in glob.glob("/usr/local/*/bin/nvdisasm")
                        + glob.glob("/usr/local/cuda*/bin/cuobjdump")})
    env = dict(os.environ, MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump,
               PATH=":".join([*cuda_bins, os.environ.get("PATH", "")]))
    code = ("import sys, os; sys.path.insert(0, os.getcwd()); import jax, jax.numpy as jnp\n"
            "from pallas_kernels.linear import mosaic_gpu as mg; from qspec_jax.bench import w4a16 as b\n"
            "from pallas_kernels.linear import layout as lay\n"
            "k, n = 4096, 4096\n"
            "p = lay.pack_quantized(b._gen_int4(jax.random.PRNGKey(0), k=k, n=n, g=32))\n"
            "x = jnp.ones((1, k), jnp.bfloat16)\n"
            "jax.block_until_ready(jax.jit(lambda x, p: mg.int4_matmul_mgpu(x, p))(x, p))\n"
            "jax.block_until_ready(jax.jit(lambda x, p: mg.int4_matmul_mgpu(x, p, variant='wgmma'))(x, p))\n"
            "w = jnp.ones((k, n), jnp.bfloat16)\n"
            "jax.block_until_ready(jax.jit(lambda x, w: mg.bf16_matmul_mgpu(x, w))(x, w))\n")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    log(f"sass dump: rc={r.returncode} ({time.perf_counter() - t0:.1f} s) {r.stderr[-500:] if r.returncode else ''}")
    with open(os.path.join(dump, "stdout.txt"), "w") as f:
        f.write(r.stdout + "\n----stderr----\n" + r.stderr)
    with tarfile.open(os.path.join(out_dir, "sass_dump.tgz"), "w:gz") as tf:
        tf.add(dump, arcname="mosaic_dump")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--check-shapes", default=",".join(CHECK_SHAPES))
    ap.add_argument("--check-groups", default="32,64,128")
    ap.add_argument("--check-m", default="5,16")
    ap.add_argument("--skip", default="",
                    help="comma list of: correctness,rows,sass,diag,fused,bf16swiglu,fused_timing,timing")
    ap.add_argument("--fused-budget", type=float, default=60.0, help="seconds for the fused kernels' timing (per M)")
    ap.add_argument("--fused-time-m", default="1", help="comma list of row counts for the fused kernels' timing")
    ap.add_argument("--fused-time-cases", default="8b", help="comma list of: 8b, smollm2 (the fused timing's shapes)")
    ap.add_argument("--fused-m", default="1,16",
                    help="rows of the fused checks (above 24: the wide exchange, e.g. 1,16,32,64)")
    ap.add_argument("--fused-cases", default="8b", help="comma list of: 8b, smollm2 (the fused checks' shapes)")
    ap.add_argument("--rows-m", default="5,8,16,24")
    ap.add_argument("--bench-shapes", default="qkv,o,gate_up,down,lm_head,s_qkv,s_gate_up")
    ap.add_argument("--bench-m", default="1,16")
    ap.add_argument("--bench-groups", default="32,128")
    ap.add_argument("--bench-impls", default="bf16,mosaic_bf16,mosaic_int4,tinygemm")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the timing part")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes, interpret-mode twins (CPU)")
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        DRY["interpret"] = True
        CHECK_SHAPES.clear()
        CHECK_SHAPES["tiny"] = (256, 64)
        args.check_shapes, args.check_groups, args.check_m = "tiny", "32", "3"
        args.skip = ",".join({"sass", "timing", *args.skip.split(",")} - {""})
    os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    dev = jax.devices()[0]
    log(f"device {dev.device_kind} cc={getattr(dev, 'compute_capability', None)} jax {jax.__version__} "
        f"date {time.strftime('%Y-%m-%d')}")
    results: list[dict] = []
    t0 = time.perf_counter()
    if "sass" not in skip:
        dump_sass(args.out, log)
    if "correctness" not in skip:
        shapes = {s: CHECK_SHAPES[s] for s in args.check_shapes.split(",")}
        check_correctness(shapes, [int(g) for g in args.check_groups.split(",")],
                          [int(m) for m in args.check_m.split(",")], results, log)
    if "rows" not in skip:
        check_row_invariance(results, log, ms=(3,) if DRY["interpret"] else tuple(int(v) for v in args.rows_m.split(",")),
                             cases=[("int4", "tiny", 256, 64, 32), ("bf16", "tiny", 256, 64, None)]
                             if DRY["interpret"] else None)
    if "diag" not in skip and not DRY["interpret"]:
        time_diagnostics(results, log)
    if "fused" not in skip:
        if DRY["interpret"]:  # tiny shapes the twin runs in seconds
            check_fused(results, log, cases=(("tiny", 128, 256, mg.Epilogue(norm=True, swiglu=True)),
                                             ("tiny", 128, 128, mg.Epilogue(residual=True))), ms=(3,))
        else:
            cases = {"8b": FUSED_CASES, "smollm2": SMOL_FUSED_CASES}
            check_fused(results, log, cases=sum((cases[c] for c in args.fused_cases.split(",")), ()),
                        ms=tuple(int(m) for m in args.fused_m.split(",")))
    if "bf16swiglu" not in skip:
        check_bf16_swiglu(results, log, **(dict(shapes=(("tiny", 128, 256),), ms=(3,)) if DRY["interpret"] else {}))
    if "fused_timing" not in skip and not DRY["interpret"]:
        cases = {"8b": FUSED_CASES, "smollm2": SMOL_FUSED_CASES}
        for m in (int(v) for v in args.fused_time_m.split(",")):
            time_fused(results, log, cases=sum((cases[c] for c in args.fused_time_cases.split(",")), ()),
                       budget_s=args.fused_budget, m=m)
    log(f"checks done in {time.perf_counter() - t0:.1f} s")
    records = []
    if "timing" not in skip:
        shapes = {s: bench.BENCH_SHAPES[s] for s in args.bench_shapes.split(",")}
        records = bench.run(shapes=shapes, m_values=tuple(int(m) for m in args.bench_m.split(",")),
                            groups=tuple(int(g) for g in args.bench_groups.split(",")),
                            impls=tuple(args.bench_impls.split(",")), variants=args.variants,
                            time_budget_s=args.budget, log=log)
    with open(os.path.join(args.out, "check_w4a16.json"), "w") as f:
        json.dump({"checks": results, "records": records, "log": lines}, f, indent=1, default=str)
    for r in results:
        if r.get("check") == "diag":
            print(f"diag {r['shape']:8s} {r['diag']:8s} {r['us']:8.2f} us {r['tb_s']:5.2f} TB/s")
    n_bad = sum(1 for r in results if not str(r.get("status", "")).startswith("ok"))
    print("\n==== summary ====")
    print(f"checks: {len(results)} run, {n_bad} not ok")
    for r in results:
        if not str(r.get("status", "")).startswith("ok"):
            print("  BAD", {k: r[k] for k in r if k in ("check", "shape", "G", "M", "config", "status", "rel_f32")})
    if records:
        rows = bench.summary_rows(records)
        print("shape        G  M   bf16us  mbf16us  int4us  tinyus floorus %ceil xbf16 xtiny  bf16/mbf16")
        for r in rows:
            print(f"{r[0]:10s} {r[2]!s:>4} {r[3]:2d} {r[4]:8.1f} {r[5]:8.1f} {r[6]:7.1f} {r[8]:7.1f} {r[10]:7.1f} "
                  f"{r[11]:5.1f} {r[12]:5.2f} {r[13]:5.2f} {r[14]:6.2f}")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
