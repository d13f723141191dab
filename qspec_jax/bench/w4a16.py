"""W4A16 matmul benchmark: Pallas kernel vs XLA's dequantize->dot vs the bf16 dense matmul.

    python -m qspec_jax.bench.w4a16 --out w4a16.json            # GPU (H100: ~2-3 minutes)
    python -m qspec_jax.bench.w4a16 --quick                     # CPU smoke test (interpret mode)

For Llama-3.1-8B linear shapes (K x N) and INT4 group size G (default 64), at M in {1, 8, 32}:

* `pallas`   `pallas_kernels.w4a16.w4a16_matmul` with its shape heuristic and two variants (the
             other mode, another split); every variant is timed and reported, the best is marked.
* `xla_dq`   `x @ qw.dequantize().astype(x.dtype)` jitted: the compiled HLO is inspected to record
             whether XLA fused the dequantization into the dot (a Triton gemm fusion) or
             materialized a bf16 [K, N] weight (`xla_fusion` in the records).
* `bf16`     `x @ W_bf16`, the dense reference.

Method (SPEC §7, device METHOD.md): each implementation runs U >= 4 ops per iteration of one
jitted `lax.fori_loop`; op u reads its own activation x_u and weight copy u % C and runs after op
u - 1. `lax.optimization_barrier`s (no-ops at run time; XLA GPU removes them only after
scheduling) hide that x and the weights are loop-invariant, so neither the ops nor a weight-only
part such as XLA's dequantization can be hoisted out of the loop, and no extra kernel is added;
the compiled HLO is checked for a hoisted dequantization anyway (status SUSPECT), as is any
result faster than 1.15x the copy roofline. C copies make the working set >= 128 MB whenever one
copy fits in L2 (50 MB), so the weights stream from HBM as in a real decode step. Per-op time =
call time / (iters * U), median of 5 trials of 2 back-to-back calls after a warm-up call, with
iters chosen so one call runs ~5 ms. The time includes the launch gaps between back-to-back
kernels (and, for split-K, the small reduction kernel): it is what one such op costs inside a
jitted decode step. Configurations are visited M-major (all shapes at M=1 first); those left when
`time_budget_s` (default 170 s) is spent are recorded as SKIPPED.

Correctness on the device before timing: every variant's warm-up outputs are compared with a
float32 oracle (`QuantizedWeight.dequantize()` then x @ W in float32); the default config also
runs once with a NaN-poisoned output buffer (every element must be written). A variant that
disagrees is reported as FAIL with no time.

bytes: what the op must move at least: int4 = packed + scale + zero + x + out, bf16 = W + x + out.
TB/s = bytes / time; %copy = TB/s over a device-to-device copy measured in the same run (bytes
read + written).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.w4a16 import W4A16Config, default_config, w4a16_matmul
from qspec_jax.bench.timing import copy_bandwidth
from qspec_jax.weight_quant import QuantizedWeight

# Llama-3.1-8B linear shapes (K = Din, N = Dout).
LLAMA3_8B_SHAPES: dict[str, tuple[int, int]] = {
    "q_o": (4096, 4096),
    "k_v": (4096, 1024),
    "gate_up": (4096, 14336),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
QUICK_SHAPES: dict[str, tuple[int, int]] = {"tiny_a": (256, 256), "tiny_b": (512, 128)}
RECORD_KEYS = ("shape", "K", "N", "G", "M", "impl", "variant", "status", "ms", "bytes", "tb_s",
               "frac_copy", "floor_ms", "speedup_vs_bf16", "rel_err", "best", "copies", "ops_per_iter", "iters",
               "trial_ms", "config", "xla_fusion")
L2_DEFEAT_BYTES = 128 * 2**20  # working set per loop >= this (H100 L2 50 MB, H200 60 MB)
MAX_COPIES = 64
TOL_BF16 = 2e-2  # bf16 activations and outputs (the kernel itself lands near 3e-3)


# ----------------------------------------------------------------------------------- data
def _int4_bytes(k: int, n: int, g: int, sdt_bytes: int = 2) -> int:
    return k * n // 2 + 2 * (k // g) * n * sdt_bytes


@functools.partial(jax.jit, static_argnames=("k", "n", "g"))
def _gen_int4(key: jax.Array, *, k: int, n: int, g: int) -> QuantizedWeight:
    """Random INT4 weight in the draft format (random codes, f16 scale > 0, zero = -7.5 scale)."""
    k1, k2 = jax.random.split(key)
    packed = jax.random.bits(k1, (k // 2, n), jnp.uint8)
    scale = (0.001 + 0.002 * jnp.abs(jax.random.normal(k2, (k // g, n), jnp.float32)))
    return QuantizedWeight(packed=packed, scale=scale.astype(jnp.float16),
                           zero=(-7.5 * scale).astype(jnp.float16))


@functools.partial(jax.jit, static_argnames=("k", "n"))
def _gen_bf16(key: jax.Array, *, k: int, n: int) -> jax.Array:
    return (0.02 * jax.random.normal(key, (k, n), jnp.float32)).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("m", "k", "u", "dtype"))
def _gen_x(key: jax.Array, *, m: int, k: int, u: int, dtype: Any) -> tuple[jax.Array, ...]:
    xs = jax.random.normal(key, (u, m, k), jnp.float32).astype(dtype)
    return tuple(xs[i] for i in range(u))


@jax.jit
def _oracle(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    return jnp.dot(x.astype(jnp.float32), qw.dequantize(), precision=lax.Precision.HIGHEST)


@jax.jit
def _rel_err(y: jax.Array, ref: jax.Array) -> jax.Array:
    y = y.astype(jnp.float32)
    bad = jnp.any(~jnp.isfinite(y))
    err = jnp.linalg.norm(y - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30)
    return jnp.where(bad, jnp.inf, err)


def _copies(nbytes: int) -> int:
    if nbytes * 2 >= L2_DEFEAT_BYTES:
        return 1
    return int(min(MAX_COPIES, max(2, math.ceil(L2_DEFEAT_BYTES / nbytes))))


# --------------------------------------------------------------------------------- timing
def _loop_fn(op: Callable, iters: int) -> Callable:
    """(xs, ws, ys0) -> ys: `iters` iterations of ys[u] = op(xs[u], ws[u % C]).

    The optimization barriers are no-ops at run time (XLA removes them after scheduling); until
    then they hide that xs and ws are loop-invariant (so neither the ops nor a weight-only part
    such as XLA's dequantization can be hoisted out of the loop) and chain op u after op u - 1."""

    def f(xs, ws, ys0):
        def body(i, carry):
            xs_c, _ = carry
            ws_i, _ = lax.optimization_barrier((ws, i))  # weights opaque per iteration: no hoisting
            ys, prev = [], None
            for u in range(len(xs_c)):
                x = xs_c[u]
                if prev is not None:  # op u runs after op u - 1 (as in a model; no horizontal fusion)
                    x, _ = lax.optimization_barrier((x, prev))
                prev = op(x, ws_i[u % len(ws_i)])
                ys.append(prev)
            return lax.optimization_barrier((xs_c, tuple(ys)))  # keeps xs opaque: nothing is hoisted

        return lax.fori_loop(0, iters, body, (xs, ys0))[1]  # xs are not returned: no output copy

    return f


def _time_loop(op: Callable, xs: tuple, ws: tuple, out_shape: tuple, out_dtype: Any, *, iters: int,
               trials: int, calls: int) -> tuple[Any, list[float], str]:
    """Compiles and times the loop; returns (warm-up ys, per-op seconds per trial, compiled HLO)."""
    ys0 = tuple(jnp.zeros(out_shape, out_dtype) for _ in xs)
    compiled = jax.jit(_loop_fn(op, iters)).lower(xs, ws, ys0).compile()
    ys = compiled(xs, ws, ys0)
    jax.block_until_ready(ys)
    per_op = []
    for _ in range(trials):
        t0 = time.perf_counter()
        outs = [compiled(xs, ws, ys0) for _ in range(calls)]
        jax.block_until_ready(outs)
        per_op.append((time.perf_counter() - t0) / (calls * iters * len(xs)))
        del outs
    try:
        text = compiled.as_text()
    except Exception:  # pragma: no cover - backend without text
        text = ""
    return ys, per_op, text


def _iters_for(est_op_s: float, u: int, target_s: float, quick: bool) -> int:
    if quick:
        return 1
    return int(min(2000, max(2, round(target_s / (est_op_s * u)))))


def measure_copy_bandwidth(nbytes: int = 2**30, *, quick: bool = False) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written), in this benchmark's record form."""
    n = 2**20 if quick else nbytes
    bps = copy_bandwidth(n, 1 if quick else 5)
    return {"impl": "d2d_copy", "status": "ok", "bytes": 2 * n, "ms": 2 * n / bps * 1e3, "tb_s": bps / 1e12}


# ----------------------------------------------------------------------------- inspection
def xla_fusion_summary(hlo_text: str, k: int, n: int) -> dict[str, Any]:
    """Did XLA fuse the dequantization into the dot? Reads a compiled (optimized) HLO module."""
    lines = hlo_text.splitlines()
    fused_names = set()
    for line in lines:
        if " fusion(" in line and "calls=" in line:
            for part in line.split("calls=")[1:]:
                fused_names.add(part.split(",")[0].split(" ")[0].strip().lstrip("%"))
    materialized = hoisted = False
    comp, in_entry = None, False
    w_shape = f"bf16[{k},{n}]"
    for line in lines:
        s = line.strip()
        if s.endswith("{") and " = " not in s and not s.startswith("ROOT"):
            in_entry = s.startswith("ENTRY")
            comp = s.split()[1 if in_entry else 0].lstrip("%").split("(")[0].strip()
            continue
        if comp is None or comp in fused_names or " = " not in s:
            continue
        if in_entry and any(f"= {dt}[{k},{n}]" in s for dt in ("bf16", "f16", "f32")):
            hoisted = True  # a dequantized weight computed outside the timing loop
        elif f"= {w_shape}" in s:
            materialized = True
    triton_gemm = "__triton_gemm" in hlo_text or "triton_gemm" in hlo_text or "__triton_nested_gemm" in hlo_text
    cublas = "__cublas$gemm" in hlo_text or "__cublas$lt$matmul" in hlo_text
    targets = sorted({seg.split('"')[1] for seg in hlo_text.split('custom_call_target=')[1:] if '"' in seg})
    if triton_gemm and not materialized:
        verdict = "fused: dequantization inside a Triton gemm fusion"
    elif materialized:
        verdict = "materialized: bf16 weights written to memory, then " + ("cuBLAS" if cublas else "a dot kernel")
    else:
        verdict = "other (no Triton gemm fusion, no bf16 [K,N] buffer): see custom_calls"
    if hoisted:
        verdict = "HOISTED: the dequantization was moved out of the timing loop; " + verdict
    return {"triton_gemm_fusion": triton_gemm, "cublas": cublas, "materialized_bf16_w": materialized,
            "hoisted_out_of_loop": hoisted, "custom_calls": targets, "verdict": verdict}


# ------------------------------------------------------------------------------ variants
def pallas_variants(m: int, k: int, n: int, g: int, quick: bool = False) -> list[W4A16Config]:
    """The heuristic's config first, then the other mode, then another split (or block_n)."""
    base = default_config(m, k, n, g)
    out = [base, base.replace(mode="dequant" if base.mode == "folded" else "folded")]
    if quick:
        return out
    ng = k // g
    bigger = [d for d in range(base.k_splits + 1, ng // 2 + 1) if ng % d == 0]
    if bigger and (n // base.block_n) * bigger[0] <= 8 * 132:
        out.append(base.replace(k_splits=bigger[0]))
    elif base.k_splits > 1:
        smaller = [d for d in range(1, base.k_splits) if ng % d == 0]
        out.append(base.replace(k_splits=smaller[-1]))
    else:
        out.append(base.replace(block_n=64 if base.block_n == 128 else 128))
    return out


def _variant_name(cfg: W4A16Config) -> str:
    return f"{cfg.mode}/bn{cfg.block_n}/ks{cfg.k_splits}/w{cfg.num_warps}s{cfg.num_stages}"


# ---------------------------------------------------------------------------------- run
def _record(**kw: Any) -> dict[str, Any]:
    rec = {key: None for key in RECORD_KEYS}
    rec.update(kw)
    return rec


def run(shapes: dict[str, tuple[int, int]] | None = None, m_values: tuple[int, ...] = (1, 8, 32),
        quick: bool = False, groups: tuple[int, ...] = (64,), time_budget_s: float = 170.0,
        target_call_s: float = 5e-3, trials: int = 5, log: Callable[[str], None] = print) -> list[dict]:
    """Runs the benchmark; returns one record per (shape, G, M, impl, variant) plus a copy record.

    quick=True: tiny shapes, interpret mode, one iteration (a CPU smoke test of the harness).
    Configurations left when `time_budget_s` is spent are recorded as SKIPPED.
    """
    t_start = time.perf_counter()
    if shapes is None:
        shapes = QUICK_SHAPES if quick else LLAMA3_8B_SHAPES
    if quick:
        m_values = tuple(m for m in m_values if m <= 8) or (1,)
        trials, calls = 1, 1
    else:
        calls = 2
    interpret = jax.default_backend() != "gpu"
    xdt = jnp.bfloat16
    records: list[dict] = []

    copy = measure_copy_bandwidth(quick=quick)
    copy_tb_s = copy["tb_s"]
    records.append(_record(**{k: v for k, v in copy.items() if k in RECORD_KEYS}))
    log(f"device: {jax.devices()[0].device_kind}  backend: {jax.default_backend()}  jax {jax.__version__}"
        f"  d2d copy: {copy_tb_s:.3f} TB/s (read + write){'  [interpret mode]' if interpret else ''}")
    log(HEADER)

    key = jax.random.PRNGKey(0)
    for m in m_values:
        for name, (k, n) in shapes.items():
            for g in groups:
                if k % g:
                    continue
                if time.perf_counter() - t_start > time_budget_s:
                    records.append(_record(shape=name, K=k, N=n, G=g, M=m, impl="all",
                                           status="SKIPPED (time budget)"))
                    log(f"SKIPPED {name} G={g} M={m}: time budget {time_budget_s:.0f} s spent")
                    continue
                key, sub = jax.random.split(key)
                try:
                    records += _run_one(name, k, n, g, m, sub, xdt=xdt, quick=quick, interpret=interpret,
                                        copy_tb_s=copy_tb_s, target_call_s=target_call_s,
                                        trials=trials, calls=calls, log=log)
                except Exception as e:  # keep going: report and move on
                    records.append(_record(shape=name, K=k, N=n, G=g, M=m, impl="all",
                                           status=f"ERROR: {type(e).__name__}: {e}"[:300]))
                    log(f"ERROR {name} G={g} M={m}: {type(e).__name__}: {e}")
                    traceback.print_exc()
                gc.collect()
    log(f"total {time.perf_counter() - t_start:.1f} s")
    return records


def _run_one(name: str, k: int, n: int, g: int, m: int, key: jax.Array, *, xdt: Any, quick: bool,
             interpret: bool, copy_tb_s: float, target_call_s: float, trials: int, calls: int,
             log: Callable[[str], None]) -> list[dict]:
    t0 = time.perf_counter()
    isz = jnp.dtype(xdt).itemsize
    io_bytes = m * k * isz + m * n * isz
    b4 = _int4_bytes(k, n, g) + io_bytes
    b16 = k * n * 2 + io_bytes
    c4, c16 = (2, 2) if quick else (_copies(b4), _copies(b16))
    # >= 4 ops per loop iteration: the loop's own per-iteration cost is spread over them.
    u_min = 2 if quick else 4
    u4, u16 = max(c4, u_min), max(c16, u_min)
    kq, kb, kx = jax.random.split(key, 3)
    qws = tuple(_gen_int4(kk, k=k, n=n, g=g) for kk in jax.random.split(kq, c4))
    xs4 = _gen_x(kx, m=m, k=k, u=u4, dtype=xdt)
    common = dict(shape=name, K=k, N=n, G=g, M=m)
    recs: list[dict] = []

    # float32 oracles for the outputs that get checked: op 0 (copy 0) and the last op.
    last = u4 - 1
    refs = {0: _oracle(xs4[0], qws[0]), last: _oracle(xs4[last], qws[last % c4])}

    def check(ys) -> float:
        return max(float(_rel_err(ys[u], r)) for u, r in refs.items())

    def finish(rec: dict, per_op: list[float], nbytes: int) -> dict:
        t = statistics.median(per_op)
        if not quick and nbytes / t / 1e12 > 1.15 * copy_tb_s:
            rec["status"] = "SUSPECT (faster than the copy roofline: cached or hoisted?)"
        rec.update(ms=t * 1e3, bytes=nbytes, tb_s=nbytes / t / 1e12, frac_copy=nbytes / t / 1e12 / copy_tb_s,
                   floor_ms=nbytes / (copy_tb_s * 1e12) * 1e3, trial_ms=[p * 1e3 for p in per_op])
        return rec

    # ---- Pallas variants
    est4 = b4 / 2.0e12 + 3e-6
    iters4 = _iters_for(est4, u4, target_call_s, quick)
    pallas_recs = []
    for i, cfg in enumerate(pallas_variants(m, k, n, g, quick)):
        vname = _variant_name(cfg)
        rec = _record(**common, impl="pallas", variant=vname, config=cfg.__dict__.copy(), copies=c4,
                      ops_per_iter=u4, iters=iters4)
        op = jax.jit(functools.partial(_pallas_op, cfg=cfg, interpret=interpret))
        try:
            if i == 0:  # poisoned output: every element must be written
                y = jax.jit(functools.partial(_pallas_op, cfg=cfg, interpret=interpret, check_writes=True))(
                    xs4[0], qws[0])
                err0 = float(_rel_err(y, refs[0]))
                if not err0 <= TOL_BF16:
                    rec.update(status=f"FAIL (poisoned-output check: rel_err {err0:.3g}, NaN = unwritten)",
                               rel_err=err0)
                    log(f"FAIL {name} G={g} M={m} pallas[{vname}]: poisoned-output check rel_err={err0:.3g}")
                    recs.append(rec)
                    continue
            ys, per_op, _ = _time_loop(op, xs4, qws, (m, n), xdt, iters=iters4, trials=trials, calls=calls)
            err = check(ys)
            rec["rel_err"] = err
            if not err <= TOL_BF16:
                rec["status"] = f"FAIL (rel_err {err:.3g} > {TOL_BF16})"
                log(f"FAIL {name} G={g} M={m} pallas[{vname}]: rel_err={err:.3g} vs float32 oracle")
            else:
                rec["status"] = "ok"
                finish(rec, per_op, b4)
                pallas_recs.append(rec)
        except Exception as e:
            rec["status"] = f"ERROR: {type(e).__name__}: {e}"[:300]
            log(f"ERROR {name} G={g} M={m} pallas[{vname}]: {type(e).__name__}: {str(e)[:200]}")
        recs.append(rec)
    if pallas_recs:
        min(pallas_recs, key=lambda r: r["ms"])["best"] = True

    # ---- XLA dequantize -> dot
    ys = None
    rec = _record(**common, impl="xla_dq", variant="x @ qw.dequantize().astype(x.dtype)", copies=c4,
                  ops_per_iter=u4, iters=iters4)
    try:
        ys, per_op, text = _time_loop(jax.jit(_xla_dq_op), xs4, qws, (m, n), xdt, iters=iters4,
                                      trials=trials, calls=calls)
        rec["xla_fusion"] = xla_fusion_summary(text, k, n)
        err = check(ys)
        rec["rel_err"] = err
        if not err <= TOL_BF16:
            rec["status"] = f"FAIL (rel_err {err:.3g} > {TOL_BF16})"
            log(f"FAIL {name} G={g} M={m} xla_dq: rel_err={err:.3g}")
        else:
            rec["status"] = "ok"
            finish(rec, per_op, b4)
            if rec["xla_fusion"]["hoisted_out_of_loop"] and not quick:
                rec["status"] = "SUSPECT (dequantization hoisted out of the timing loop)"
    except Exception as e:
        rec["status"] = f"ERROR: {type(e).__name__}: {e}"[:300]
        log(f"ERROR {name} G={g} M={m} xla_dq: {type(e).__name__}: {str(e)[:200]}")
    recs.append(rec)
    del qws, ys
    gc.collect()

    # ---- bf16 dense reference
    wbs = tuple(_gen_bf16(kk, k=k, n=n) for kk in jax.random.split(kb, c16))
    xs16 = xs4[:u16] if u16 <= u4 else _gen_x(kx, m=m, k=k, u=u16, dtype=xdt)
    est16 = b16 / 2.5e12 + 3e-6
    iters16 = _iters_for(est16, u16, target_call_s, quick)
    rec16 = _record(**common, impl="bf16", variant="x @ W_bf16", copies=c16, ops_per_iter=u16,
                    iters=iters16)
    try:
        _, per_op, _ = _time_loop(jax.jit(_bf16_op), xs16, wbs, (m, n), xdt, iters=iters16, trials=trials,
                                  calls=calls)
        rec16["status"] = "ok"
        finish(rec16, per_op, b16)
    except Exception as e:
        rec16["status"] = f"ERROR: {type(e).__name__}: {e}"[:300]
        log(f"ERROR {name} G={g} M={m} bf16: {type(e).__name__}: {str(e)[:200]}")
    recs.append(rec16)
    del wbs
    if rec16.get("ms"):
        rec16["speedup_vs_bf16"] = 1.0
        for r in recs:
            if r.get("ms") and r is not rec16:
                r["speedup_vs_bf16"] = rec16["ms"] / r["ms"]
    log(format_rows(recs) + f"   ({time.perf_counter() - t0:.1f} s)")
    return recs


def _pallas_op(x, qw, *, cfg: W4A16Config, interpret: bool, check_writes: bool = False):
    return w4a16_matmul(x, qw.packed, qw.scale, qw.zero, config=cfg, interpret=interpret,
                        check_writes=check_writes)


def _xla_dq_op(x, qw):
    return x @ qw.dequantize().astype(x.dtype)


def _bf16_op(x, w):
    return x @ w


# --------------------------------------------------------------------------------- output
HEADER = (f"{'shape':8s} {'KxN':>12s} {'G':>3s} {'M':>3s} {'impl':7s} {'variant':34s} {'ms':>9s} "
          f"{'MB':>8s} {'TB/s':>6s} {'%copy':>6s} {'xbf16':>6s}  status")


def format_table(records: list[dict]) -> str:
    copy = next((r for r in records if r.get("impl") == "d2d_copy"), None)
    lines = []
    if copy:
        lines.append(f"d2d copy: {copy['tb_s']:.3f} TB/s ({copy['ms']:.3f} ms for {copy['bytes'] / 1e9:.2f} GB)")
    lines += [HEADER, "-" * len(HEADER), format_rows(records)]
    return "\n".join(lines)


def format_rows(records: list[dict]) -> str:
    """One line per record (ms '-' and a FAIL/ERROR status where it did not pass)."""
    lines = []
    for r in records:
        if r.get("impl") == "d2d_copy":
            continue
        kn = f"{r['K']}x{r['N']}" if r.get("K") else ""
        variant = (r.get("variant") or "")[:34]
        if r.get("best"):
            variant = ("*" + variant)[:34]
        if r.get("ms") is not None:
            nums = (f"{r['ms']:9.4f} {r['bytes'] / 1e6:8.2f} {r['tb_s']:6.3f} {100 * r['frac_copy']:5.1f}% "
                    f"{(r.get('speedup_vs_bf16') or float('nan')):6.2f}")
        else:
            nums = f"{'-':>9s} {'':8s} {'':6s} {'':6s} {'':6s}"
        status = r.get("status") or ""
        if r.get("impl") == "xla_dq" and r.get("xla_fusion"):
            status += f"  [{r['xla_fusion']['verdict']}]"
        if status.startswith("FAIL"):
            status = "FAIL " + status[4:].strip()
        lines.append(f"{r.get('shape') or '':8s} {kn:>12s} {r.get('G') or '':>3} {r.get('M') or '':>3} "
                     f"{r.get('impl') or '':7s} {variant:34s} {nums}  {status}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU smoke test)")
    ap.add_argument("--shapes", default=None, help=f"comma list of {','.join(LLAMA3_8B_SHAPES)}")
    ap.add_argument("--m", default="1,8,32", help="comma list of M values")
    ap.add_argument("--groups", default="64", help="comma list of group sizes (e.g. 64,128)")
    ap.add_argument("--time-budget", type=float, default=170.0, help="seconds; later configs are skipped")
    ap.add_argument("--doc", action="store_true", help="rewrite the W4A16 section of docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    quick = args.quick
    if jax.default_backend() != "gpu" and not quick:
        print("no GPU backend: running the quick (interpret-mode) smoke test instead", file=sys.stderr)
        quick = True
    shapes = None
    if args.shapes:
        table = QUICK_SHAPES if quick else LLAMA3_8B_SHAPES
        shapes = {s: table[s] for s in args.shapes.split(",")}
    records = run(shapes=shapes, m_values=tuple(int(v) for v in args.m.split(",")), quick=quick,
                  groups=tuple(int(v) for v in args.groups.split(",")), time_budget_s=args.time_budget)
    print(format_table(records))
    if args.out:
        meta = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                "jax_version": jax.__version__, "quick": quick}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1, default=_json_default)
        print(f"wrote {args.out}")
    if args.doc:
        write_section(records, "qspec-bench w4a16 " + " ".join(argv if argv is not None else sys.argv[1:]))
    n_fail = sum(1 for r in records if str(r.get("status", "")).startswith(("FAIL", "ERROR")))
    return 1 if n_fail else 0


def write_section(records: list[dict[str, Any]], command: str) -> None:
    """The "w4a16" section of docs/BENCHMARKS.md: the best Pallas variant, XLA and bf16 per case."""
    from qspec_jax.bench import report

    names = {"pallas": "Pallas W4A16 (best variant)", "xla_dq": "XLA dequantize→dot", "bf16": "bf16 x @ W"}
    rows = []
    for x in records:
        if x["impl"] not in names or x.get("status") != "ok" or (x["impl"] == "pallas" and not x.get("best")):
            continue
        fusion = x.get("xla_fusion")
        rows.append([x["shape"], f'{x["K"]}x{x["N"]}', x["M"], names[x["impl"]], x["ms"] * 1e3, x["bytes"] / 1e6,
                     x["tb_s"], 100 * x["frac_copy"], x["speedup_vs_bf16"],
                     fusion.get("verdict", "") if isinstance(fusion, dict) else (fusion or "")])
    copy = next(x for x in records if x["impl"] == "d2d_copy")
    env = report.environment()
    report.update_section("w4a16", (
        "## INT4 draft linears (W4A16)\n\n" + report.env_line(env, command)
        + f". Device-to-device copy in the same run: {copy['tb_s']:.2f} TB/s. Llama-3.1-8B linear shapes; median "
        "of 5 trials of an in-device loop over rotating weight copies.\n\n"
        + report.table(["shape", "K×N", "M", "implementation", "µs", "MB read", "TB/s", "% copy BW",
                        "speedup vs bf16", "XLA fusion"], rows)))


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, (jnp.dtype, np.dtype, type)):
        return str(o)
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
