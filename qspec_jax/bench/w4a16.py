"""W4A16 benchmark: every INT4-weight and bf16 decode linear in one process and one table.

    qspec-bench w4a16 --out w4a16.json --doc            # GPU: JSON, and the W4A16 section of docs/BENCHMARKS.md
    qspec-bench w4a16 --quick                           # CPU smoke test (interpret mode): writes nothing

Implementations (`impl` in the records), timed on the same shapes, M and group sizes:

* `bf16`         x @ W_bf16 through XLA (cuBLAS; the project appends --xla_gpu_enable_triton_gemm=false).
* `mosaic_bf16`  `pallas_kernels.linear.mosaic_gpu.bf16_matmul_mgpu` (Hopper; rows independent of M).
* `mosaic_int4`  `pallas_kernels.linear.mosaic_gpu.int4_matmul_mgpu` on the pre-packed layout (Hopper), its
                 default config and, with --variants, the other split-K reduction and a neighbouring split.
* `pallas`       the Triton W4A16 kernel `pallas_kernels.linear.triton.w4a16_matmul` (older GPUs' path).
* `tinygemm`     torch.ops.aten._weight_int4pack_mm (torch's int4 kernel, any of G = 32/64/128).
* `gemlite`      gemlite's GemLiteLinear (A16W4, H100 kernel configs; Triton).
* `xla_dq`       x @ qw.dequantize().astype(x.dtype) jitted (off by default outside --quick).
torch and gemlite rows say SKIPPED (with the reason) when the package is absent.

Method (SPEC §7, device METHOD.md): JAX implementations run U >= 4 ops per iteration of one jitted
`lax.fori_loop`; op u reads its own activation x_u and weight copy u % C and runs after op u - 1.
`lax.optimization_barrier`s (no-ops at run time; XLA GPU removes them only after scheduling) hide
that x and the weights are loop-invariant, so nothing is hoisted; the compiled HLO is checked for a
hoisted dequantization anyway (SUSPECT), as is any result faster than 1.15x the copy roofline. The
C copies make the working set >= 128 MB whenever one copy fits in L2 (50-60 MB), so the weights
stream from HBM as in a decode step. torch implementations replay a CUDA graph of the same U ops
over the same number of weight copies. Per-op time = median over 5 trials; the JAX time includes
the gaps between back-to-back kernels and any second kernel (the split-K "gmem" sum), i.e. what
the op costs inside a jitted decode step.

Correctness on the device before timing: every output is compared with a float32 oracle (the
same W as U * scale + zero, x @ W in float32); a variant that disagrees is FAIL with no time.

bytes: what the op must move at least (int4: packed codes + scale + zero + x + out; bf16: W + x +
out). TB/s = bytes / time; %ceil = TB/s over the device's read ceiling (`timing.read_ceiling_bps`: the
H200's measured 4.35 TB/s, SPEC §8); floor = bytes / that ceiling; %copy against a device-to-device
copy measured in the same run.
Run the GPU benchmark with XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 when torch shares the device.
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
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.linear import layout as lay
from pallas_kernels.linear import mosaic_gpu as mg
from pallas_kernels.linear.triton import W4A16Config, default_config, w4a16_matmul
from qspec_jax.bench.timing import copy_bandwidth, read_ceiling_bps
from qspec_jax.weight_quant import QuantizedWeight

# Fused Llama-3.1-8B linears (K = Din, N = Dout): q/k/v and gate/up as one matrix each.
LLAMA31_8B_FUSED: dict[str, tuple[int, int]] = {
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
# SmolLM2-135M: hidden 576, 9 heads x 64 (+ 3 KV heads), MLP 1536, vocab 49152.
SMOLLM2_FUSED: dict[str, tuple[int, int]] = {
    "s_qkv": (576, 960),
    "s_o": (576, 576),
    "s_gate_up": (576, 3072),
    "s_down": (1536, 576),
    "s_lm_head": (576, 49152),
}
BENCH_SHAPES = {**LLAMA31_8B_FUSED, **SMOLLM2_FUSED}
LLAMA3_8B_SHAPES = LLAMA31_8B_FUSED  # the name older scripts import
QUICK_SHAPES: dict[str, tuple[int, int]] = {"tiny_a": (256, 256), "tiny_b": (512, 128)}
INT4_IMPLS = ("mosaic_int4", "pallas", "tinygemm", "gemlite", "xla_dq")
BF16_IMPLS = ("bf16", "mosaic_bf16")
DEFAULT_IMPLS = ("bf16", "mosaic_bf16", "mosaic_int4", "pallas", "tinygemm", "gemlite")
QUICK_IMPLS = ("pallas", "xla_dq", "bf16")
RECORD_KEYS = ("shape", "K", "N", "G", "M", "impl", "variant", "status", "ms", "bytes", "tb_s",
               "frac_copy", "frac_ceiling", "floor_ms", "speedup_vs_bf16", "speedup_vs_tinygemm", "rel_err",
               "best", "copies", "ops_per_iter", "iters", "trial_ms", "config", "xla_fusion")
L2_DEFEAT_BYTES = 128 * 2**20  # working set per loop >= this (H100 L2 50 MB, H200 60 MB)
MAX_COPIES = 64
TOL_BF16 = 2e-2  # bf16 activations and outputs


# ----------------------------------------------------------------------------------- data
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
def _oracle_dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)


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


def poison_then(fn: Callable[[], Any], shape: tuple[int, ...], dtype: Any) -> Any:
    """Runs fn() right after freeing a NaN buffer of the output's shape: the allocator hands the
    same block to the output, so elements a kernel never writes read NaN (the Mosaic kernels'
    outputs cannot alias an input). Best effort on the device; exact in interpret mode."""
    junk = jnp.full(shape, jnp.nan, dtype)
    junk.block_until_ready()
    junk.delete()
    out = fn()
    jax.block_until_ready(out)
    return out


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


def _torch_time(op: Callable[[int], Any], u: int, trials: int, target_s: float) -> list[float]:
    """Per-op seconds of `op(u)` (u-th op: its own x and weight copy) from a CUDA graph of U ops
    replayed back to back between CUDA events, one figure per trial."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(u):  # warm-up (and any lazy compilation) outside the graph
            op(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(u):
                op(i)
        run_once = graph.replay
    except Exception:  # noqa: BLE001  (an op that cannot be captured: plain back-to-back launches)
        graph = None
        torch.cuda.synchronize()

        def run_once():
            for i in range(u):
                op(i)
    run_once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_once()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(2000, max(2, target_s / est)))
    out = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(trials):
        start.record()
        for _ in range(reps):
            run_once()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e-3 / (reps * u))
    del graph
    return out


# ------------------------------------------------------------------------------ torch peers
def _torch_status() -> str | None:
    """None when torch with CUDA is usable here, else the reason the torch peers are skipped."""
    from qspec_jax.bench.torch_decode import torch_status

    status = torch_status()
    return None if status is None else f"SKIPPED ({status})"


def _gemlite_status() -> str | None:
    status = _torch_status()
    if status:
        return status
    try:
        import gemlite  # noqa: F401
    except ImportError:
        return "SKIPPED (gemlite not installed: pip install gemlite==0.6.0)"
    return None


def _torch_weights(qw: QuantizedWeight, k: int, n: int, g: int):
    """The same INT4 weight for torch: codes [N, K] uint8, scale / centered zero [K/G, N] bf16
    (W = (U - 8) s + (z + 8 s), tinygemm's convention) and float32 W [K, N] for the oracle."""
    import torch

    codes_t = np.asarray(_codes_nk(qw))  # [N, K] uint8, U in 0..15 (transposed on the device)
    s = np.asarray(qw.scale, np.float32)
    z = np.asarray(qw.zero, np.float32)
    dev = "cuda"
    u = torch.from_numpy(codes_t).to(dev)
    st = torch.from_numpy(s).to(dev)
    zt = torch.from_numpy(z).to(dev)
    return u, st, zt


@jax.jit
def _codes_nk(qw: QuantizedWeight) -> jax.Array:
    c = qw.codes()  # [K/G, G, N]
    return jnp.transpose(c.reshape(-1, c.shape[-1])).astype(jnp.uint8)


def _tinygemm_op(u, s, z, g: int):
    """(packed int4 weight, scales_and_zeros) for torch.ops.aten._weight_int4pack_mm."""
    import torch

    from qspec_jax.bench.torch_decode import tinygemm_pack

    packed_u8 = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8)  # [N, K/2]: even k high nibble
    w = tinygemm_pack(packed_u8.contiguous())
    sz = torch.stack([s, z + 8.0 * s], dim=-1).to(torch.bfloat16).contiguous()  # [K/G, N, 2]
    return w, sz


def _gemlite_layer(u, s, z, k: int, n: int, g: int):
    import torch
    from gemlite import DType, GemLiteLinear

    layer = GemLiteLinear(4, group_size=g, in_features=k, out_features=n, input_dtype=DType.BF16,
                          output_dtype=DType.BF16)
    # HQQ form W = (U - zq) * s with zq = -z / s; gemlite folds it back to U * s + z (fma mode).
    zq = (-z / s).t().contiguous()
    layer.pack(u.contiguous(), s.t().contiguous().to(torch.bfloat16), zq.to(torch.bfloat16), None)
    return layer


_GEMLITE_READY = False


def _gemlite_setup() -> None:
    """Load gemlite's tuned H100 kernel configs (no H200 table ships; autotuning per shape would
    take minutes)."""
    global _GEMLITE_READY
    if _GEMLITE_READY:
        return
    import os

    import gemlite
    from gemlite.core import GemLiteLinearTriton

    path = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    if os.path.exists(path):
        GemLiteLinearTriton.load_config(path)
    _GEMLITE_READY = True


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



def mosaic_variants(k: int, n: int, g: int | None, variants: bool, m: int = 1,
                    interpret: bool = False) -> list[tuple[mg.MgpuConfig, str]]:
    """(config, kernel) pairs: the default first (what a call of M rows gets: its split-K sum
    from `mg.reduce_mode`, in-cluster only up to 24 rows); with `variants`, the other INT4 kernel
    ("wgmma" register operand), the other split-K reduction, the other warpgroup count and twice
    the splits (each only where valid)."""
    reduce = mg.reduce_mode(m, interpret)
    base = mg.default_config(k, n, g, reduce=reduce)
    kern = "mma" if g is not None else "wgmma"
    cluster_ok = reduce == "cluster"  # above 24 rows the cluster sum does not lower
    out = [(base, kern)]
    if not variants:
        return out
    if g is not None:
        out.append((base, "wgmma"))
        out.append((base.replace(tma_view="wide"), kern))  # the diagnosed TMA fix (docs/kernel_notes.md)
    if base.splits > 1:
        other = "cluster" if base.reduce == "gmem" else "gmem"
        if other == "gmem" or (cluster_ok and base.splits <= mg.MAX_CLUSTER):
            out.append((base.replace(reduce=other), kern))
    steps = k // base.k_tile
    wgs = 3 - base.wgs
    if n % (lay.ROWS * wgs) == 0:
        s = base.splits * 2 if wgs == 2 else max(1, base.splits // 2)
        while s > 1 and (steps % s or steps // s < 2):
            s //= 2
        out.append((base.replace(wgs=wgs, splits=s,
                                 reduce="cluster" if cluster_ok and 1 < s <= mg.MAX_CLUSTER else "gmem"), kern))
    s = base.splits * 2
    if steps % s == 0 and steps // s >= 2 and k // s >= 512:
        out.append((base.replace(splits=s, reduce="cluster" if cluster_ok and s <= mg.MAX_CLUSTER else "gmem"),
                    kern))
    return out


def _mosaic_name(cfg: mg.MgpuConfig, kernel: str = "") -> str:
    red = f"/{cfg.reduce}" if cfg.splits > 1 else ""
    wide = "/wide" if cfg.tma_view == "wide" else ""
    return f"{kernel + '/' if kernel else ''}wgs{cfg.wgs}/kt{cfg.k_tile}/S{cfg.splits}{red}{wide}"


# ---------------------------------------------------------------------------------- run
def _record(**kw: Any) -> dict[str, Any]:
    rec = {key: None for key in RECORD_KEYS}
    rec.update(kw)
    return rec


def run(shapes: dict[str, tuple[int, int]] | None = None, m_values: tuple[int, ...] = (1, 8, 32),
        quick: bool = False, groups: tuple[int, ...] = (64,), time_budget_s: float = 170.0,
        target_call_s: float = 5e-3, trials: int = 5, impls: tuple[str, ...] | None = None,
        variants: bool = False, log: Callable[[str], None] = print) -> list[dict]:
    """Runs the benchmark; returns one record per (shape, G, M, impl, variant) plus a copy record
    (bf16 implementations: one record per (shape, M), G = None).

    quick=True: tiny shapes, interpret mode, one iteration (a CPU smoke test of the harness);
    the Mosaic implementations then run their interpret-mode twins. Configurations left when
    `time_budget_s` is spent are recorded as SKIPPED.
    """
    t_start = time.perf_counter()
    if shapes is None:
        shapes = QUICK_SHAPES if quick else BENCH_SHAPES
    impls = tuple(impls or (QUICK_IMPLS if quick else DEFAULT_IMPLS))
    unknown = set(impls) - set(INT4_IMPLS) - set(BF16_IMPLS)
    if unknown:
        raise ValueError(f"unknown impls {sorted(unknown)}; expected some of {INT4_IMPLS + BF16_IMPLS}")
    if quick:
        m_values = tuple(m for m in m_values if m <= 8) or (1,)
        trials, calls = 1, 1
    else:
        calls = 2
    interpret = jax.default_backend() != "gpu"
    ctx = dict(quick=quick, interpret=interpret, target_call_s=target_call_s, trials=trials, calls=calls,
               log=log, variants=variants)
    first_m = m_values[0] if m_values else None
    records: list[dict] = []
    copy = measure_copy_bandwidth(quick=quick)
    ctx["copy_tb_s"] = copy["tb_s"]
    records.append(_record(**{k: v for k, v in copy.items() if k in RECORD_KEYS}))
    log(f"device: {jax.devices()[0].device_kind}  backend: {jax.default_backend()}  jax {jax.__version__}"
        f"  d2d copy: {copy['tb_s']:.3f} TB/s (read + write)  read ceiling {read_ceiling_bps() / 1e12:.2f} TB/s"
        f"{'  [interpret mode]' if interpret else ''}")
    for name, status in (("tinygemm", _torch_status()), ("gemlite", _gemlite_status())):
        if name in impls and status:
            log(f"{name}: {status}")
    log(HEADER)

    key = jax.random.PRNGKey(0)
    for m in m_values:
        for name, (k, n) in shapes.items():
            gs = [g for g in groups if k % max(64, g) == 0]
            if time.perf_counter() - t_start > time_budget_s:
                records.append(_record(shape=name, K=k, N=n, M=m, impl="all", status="SKIPPED (time budget)"))
                log(f"SKIPPED {name} M={m}: time budget {time_budget_s:.0f} s spent")
                continue
            key, kb, *kg = jax.random.split(key, 2 + len(gs))
            ctx["variants"] = variants and m == first_m  # config variants: first M only
            bf16_recs: list[dict] = []
            try:
                if set(impls) & set(BF16_IMPLS):
                    bf16_recs = _run_bf16(name, k, n, m, kb, impls, **ctx)
                    records += bf16_recs
                for g, kk in zip(gs, kg):
                    if time.perf_counter() - t_start > time_budget_s:
                        records.append(_record(shape=name, K=k, N=n, G=g, M=m, impl="all",
                                               status="SKIPPED (time budget)"))
                        continue
                    if set(impls) & set(INT4_IMPLS):
                        records += _run_int4(name, k, n, g, m, kk, impls, bf16_recs, **ctx)
                skipped = [g for g in groups if g not in gs]
                if skipped and set(impls) & set(INT4_IMPLS):
                    log(f"{name}: G={skipped} skipped (K={k} is not a multiple of max(64, G))")
            except Exception as e:  # keep going: report and move on
                records.append(_record(shape=name, K=k, N=n, M=m, impl="all",
                                       status=f"ERROR: {type(e).__name__}: {e}"[:300]))
                log(f"ERROR {name} M={m}: {type(e).__name__}: {e}")
                traceback.print_exc()
            gc.collect()
    log(f"total {time.perf_counter() - t_start:.1f} s")
    return records


def _finish(rec: dict, per_op: list[float], nbytes: int, copy_tb_s: float, quick: bool) -> dict:
    t, ceiling = statistics.median(per_op), read_ceiling_bps()
    rec.update(status=rec.get("status") or "ok", ms=t * 1e3, bytes=nbytes, tb_s=nbytes / t / 1e12,
               frac_copy=nbytes / t / 1e12 / copy_tb_s, frac_ceiling=nbytes / t / ceiling,
               floor_ms=nbytes / ceiling * 1e3, trial_ms=[p * 1e3 for p in per_op])
    if not quick and rec["tb_s"] > 1.15 * copy_tb_s:
        rec["status"] = "SUSPECT (faster than the copy roofline: cached or hoisted?)"
    return rec


def _jax_impl(rec: dict, op: Callable, xs: tuple, ws: tuple, refs: dict, out_shape: tuple, *, nbytes: int,
              iters: int, trials: int, calls: int, copy_tb_s: float, quick: bool, log: Callable,
              poison: Callable | None = None) -> dict:
    """Checks (optionally with a poisoned output first) and times one JAX implementation."""
    label = f"{rec['shape']} G={rec['G']} M={rec['M']} {rec['impl']}[{rec['variant']}]"
    try:
        if poison is not None:
            y = poison_then(lambda: poison(xs[0], ws[0]), out_shape, jnp.bfloat16)
            err0 = float(_rel_err(y, refs[0]))
            if not err0 <= TOL_BF16:
                rec.update(status=f"FAIL (poisoned-output check: rel_err {err0:.3g}; NaN = unwritten)",
                           rel_err=err0)
                log(f"FAIL {label}: poisoned-output rel_err={err0:.3g}")
                return rec
        ys, per_op, text = _time_loop(op, xs, ws, out_shape, jnp.bfloat16, iters=iters, trials=trials,
                                      calls=calls)
        err = max(float(_rel_err(ys[u], r)) for u, r in refs.items())
        rec["rel_err"] = err
        if not err <= TOL_BF16:
            rec["status"] = f"FAIL (rel_err {err:.3g} > {TOL_BF16})"
            log(f"FAIL {label}: rel_err={err:.3g} vs float32 oracle")
            return rec
        _finish(rec, per_op, nbytes, copy_tb_s, quick)
        if rec["impl"] == "xla_dq":
            rec["xla_fusion"] = xla_fusion_summary(text, rec["K"], rec["N"])
            if rec["xla_fusion"]["hoisted_out_of_loop"] and not quick:
                rec["status"] = "SUSPECT (dequantization hoisted out of the timing loop)"
    except Exception as e:
        rec["status"] = f"ERROR: {type(e).__name__}: {e}"[:300]
        log(f"ERROR {label}: {type(e).__name__}: {str(e)[:300]}")
    return rec


def _run_bf16(name: str, k: int, n: int, m: int, key: jax.Array, impls: tuple[str, ...], *, quick: bool,
              interpret: bool, copy_tb_s: float, target_call_s: float, trials: int, calls: int,
              log: Callable, variants: bool) -> list[dict]:
    t0 = time.perf_counter()
    b16 = k * n * 2 + 2 * (m * k + m * n)
    c16 = 2 if quick else _copies(b16)
    u16 = max(c16, 2 if quick else 4)
    kw, kx = jax.random.split(key)
    wbs = tuple(_gen_bf16(kk, k=k, n=n) for kk in jax.random.split(kw, c16))
    xs = _gen_x(kx, m=m, k=k, u=u16, dtype=jnp.bfloat16)
    last = u16 - 1
    refs = {0: _oracle_dense(xs[0], wbs[0]), last: _oracle_dense(xs[last], wbs[last % c16])}
    iters = _iters_for(b16 / 2.5e12 + 3e-6, u16, target_call_s, quick)
    common = dict(shape=name, K=k, N=n, G=None, M=m, copies=c16, ops_per_iter=u16, iters=iters)
    timing = dict(nbytes=b16, iters=iters, trials=trials, calls=calls, copy_tb_s=copy_tb_s, quick=quick, log=log)
    recs = []
    if "bf16" in impls:
        recs.append(_jax_impl(_record(**common, impl="bf16", variant="x @ W (XLA)"), _bf16_op, xs, wbs, refs,
                              (m, n), **timing))
    if "mosaic_bf16" in impls:
        cfgs = mosaic_variants(k, n, None, variants and not quick, m, interpret)
        for i, (cfg, _) in enumerate(cfgs):  # (in interpret mode every split sum is "gmem": mosaic_variants)
            op = functools.partial(_mosaic_bf16_op, cfg=cfg, interpret=interpret)
            recs.append(_jax_impl(_record(**common, impl="mosaic_bf16", variant=_mosaic_name(cfg),
                                          config=dataclass_dict(cfg)), op, xs, wbs, refs, (m, n),
                                  poison=op if i == 0 else None, **timing))
    _mark_best(recs, "mosaic_bf16")
    base = next((r for r in recs if r["impl"] == "bf16" and r.get("ms")), None)
    for r in recs:
        if base and r.get("ms"):
            r["speedup_vs_bf16"] = base["ms"] / r["ms"]
    log(format_rows(recs) + f"   ({time.perf_counter() - t0:.1f} s)")
    return recs


def _run_int4(name: str, k: int, n: int, g: int, m: int, key: jax.Array, impls: tuple[str, ...],
              bf16_recs: list[dict], *, quick: bool, interpret: bool, copy_tb_s: float, target_call_s: float,
              trials: int, calls: int, log: Callable, variants: bool) -> list[dict]:
    t0 = time.perf_counter()
    io = 2 * (m * k + m * n)
    b4 = lay.packed_bytes(k, n, g) + io  # (the Triton layout's float16 scale / zero: the same 4 bytes a group)
    c4 = 2 if quick else _copies(b4)
    u4 = max(c4, 2 if quick else 4)
    kq, kx = jax.random.split(key)
    qws = tuple(_gen_int4(kk, k=k, n=n, g=g) for kk in jax.random.split(kq, c4))
    xs = _gen_x(kx, m=m, k=k, u=u4, dtype=jnp.bfloat16)
    last = u4 - 1
    refs = {0: _oracle(xs[0], qws[0]), last: _oracle(xs[last], qws[last % c4])}
    iters = _iters_for(b4 / 2.0e12 + 3e-6, u4, target_call_s, quick)
    common = dict(shape=name, K=k, N=n, G=g, M=m, copies=c4, ops_per_iter=u4, iters=iters)
    timing = dict(nbytes=b4, iters=iters, trials=trials, calls=calls, copy_tb_s=copy_tb_s, quick=quick, log=log)
    recs: list[dict] = []
    if "mosaic_int4" in impls:
        try:
            packed = tuple(lay.pack_quantized(q) for q in qws)
            for i, (cfg, kern) in enumerate(mosaic_variants(k, n, g, variants and not quick, m, interpret)):
                if interpret and kern != "mma":  # (its split sums are "gmem" there: mosaic_variants)
                    continue
                op = functools.partial(_mosaic_int4_op, cfg=cfg, kernel=kern, interpret=interpret)
                recs.append(_jax_impl(_record(**common, impl="mosaic_int4", variant=_mosaic_name(cfg, kern),
                                              config={**dataclass_dict(cfg), "kernel": kern}), op, xs, packed,
                                      refs, (m, n), poison=op if i == 0 else None, **timing))
            del packed
        except Exception as e:
            recs.append(_record(**common, impl="mosaic_int4", status=f"ERROR: {type(e).__name__}: {e}"[:300]))
            log(f"ERROR {name} G={g} M={m} mosaic_int4: {e}")
    if "pallas" in impls:
        cfg = default_config(m, k, n, g) if n % 128 == 0 else None
        if cfg is None:
            recs.append(_record(**common, impl="pallas", status="SKIPPED (the Triton kernel needs N % 128 == 0)"))
        else:
            op = functools.partial(_pallas_op, cfg=cfg, interpret=interpret)
            recs.append(_jax_impl(_record(**common, impl="pallas", variant=_variant_name(cfg),
                                          config=dataclass_dict(cfg)), op, xs, qws, refs, (m, n),
                                  poison=None, **timing))
    if "xla_dq" in impls:
        recs.append(_jax_impl(_record(**common, impl="xla_dq", variant="x @ qw.dequantize().astype(x.dtype)"),
                              jax.jit(_xla_dq_op), xs, qws, refs, (m, n), **timing))
    for impl in ("tinygemm", "gemlite"):
        if impl in impls:
            recs.append(_run_torch_peer(impl, common, qws, xs, refs, k=k, n=n, g=g, nbytes=b4,
                                        copy_tb_s=copy_tb_s, trials=trials, target_call_s=target_call_s,
                                        quick=quick, log=log))
    _mark_best(recs, "mosaic_int4")
    _mark_best(recs, "pallas")
    base = next((r for r in bf16_recs if r["impl"] == "bf16" and r.get("ms")), None)
    tiny = next((r for r in recs if r["impl"] == "tinygemm" and r.get("ms")), None)
    for r in recs:
        if r.get("ms"):
            r["speedup_vs_bf16"] = base["ms"] / r["ms"] if base else None
            r["speedup_vs_tinygemm"] = tiny["ms"] / r["ms"] if tiny else None
    del qws
    gc.collect()
    log(format_rows(recs) + f"   ({time.perf_counter() - t0:.1f} s)")
    return recs


def _run_torch_peer(impl: str, common: dict, qws: tuple, xs: tuple, refs: dict, *, k: int, n: int, g: int,
                    nbytes: int, copy_tb_s: float, trials: int, target_call_s: float, quick: bool,
                    log: Callable) -> dict:
    rec = _record(**common, impl=impl, variant=f"G={g}")
    status = _torch_status() if impl == "tinygemm" else _gemlite_status()
    if status:
        rec["status"] = status
        return rec
    import torch

    try:
        if impl == "gemlite":
            _gemlite_setup()
        u4 = len(xs)
        ops_w = []
        for q in qws:
            u, s, z = _torch_weights(q, k, n, g)
            ops_w.append(_tinygemm_op(u, s, z, g) if impl == "tinygemm" else _gemlite_layer(u, s, z, k, n, g))
            del u, s, z
        txs = [torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda").to(torch.bfloat16) for x in xs]
        outs: list[Any] = [None] * u4

        def op(i: int):
            w = ops_w[i % len(ops_w)]
            if impl == "tinygemm":
                outs[i] = torch.ops.aten._weight_int4pack_mm(txs[i], w[0], g, w[1])
            else:
                outs[i] = w(txs[i])
            return outs[i]

        err = 0.0
        for u, r in refs.items():
            y = op(u).float().cpu().numpy()
            err = max(err, float(_rel_err(jnp.asarray(y), r)))
        rec["rel_err"] = err
        per_op = _torch_time(op, u4, trials, target_call_s) if not quick else [1e-3]
        _finish(rec, per_op, nbytes, copy_tb_s, quick)
        if not err <= TOL_BF16:  # the timing stands; the weight conversion above is ours to blame
            rec["status"] = f"ok (timed) but rel_err {err:.3g} vs the oracle: check the format conversion"
            log(f"WARN {common['shape']} G={g} M={common['M']} {impl}: rel_err={err:.3g}")
        ops_w.clear(), txs.clear(), outs.clear()  # free the GPU copies before the next peer
        torch.cuda.empty_cache()
    except Exception as e:
        rec["status"] = f"ERROR: {type(e).__name__}: {e}"[:300]
        log(f"ERROR {common['shape']} G={g} M={common['M']} {impl}: {type(e).__name__}: {str(e)[:300]}")
    return rec


def _mark_best(recs: list[dict], impl: str) -> None:
    mine = [r for r in recs if r["impl"] == impl and r.get("ms")]
    if mine:
        min(mine, key=lambda r: r["ms"])["best"] = True


def dataclass_dict(cfg: Any) -> dict:
    return dict(cfg.__dict__)


def _pallas_op(x, qw, *, cfg: W4A16Config, interpret: bool, check_writes: bool = False):
    return w4a16_matmul(x, qw.packed, qw.scale, qw.zero, config=cfg, interpret=interpret,
                        check_writes=check_writes)


def _mosaic_int4_op(x, p, *, cfg: mg.MgpuConfig, kernel: str, interpret: bool):
    return mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem" if interpret else kernel, interpret=interpret)


def _mosaic_bf16_op(x, w, *, cfg: mg.MgpuConfig, interpret: bool):
    return mg.bf16_matmul_mgpu(x, w, config=cfg, interpret=interpret)


def _xla_dq_op(x, qw):
    return x @ qw.dequantize().astype(x.dtype)


def _bf16_op(x, w):
    return x @ w


# --------------------------------------------------------------------------------- output
HEADER = (f"{'shape':9s} {'KxN':>12s} {'G':>3s} {'M':>3s} {'impl':11s} {'variant':28s} {'us':>9s} "
          f"{'MB':>8s} {'TB/s':>6s} {'%ceil':>6s} {'xbf16':>6s} {'xtiny':>6s}  status")


def format_table(records: list[dict]) -> str:
    copy = next((r for r in records if r.get("impl") == "d2d_copy"), None)
    lines = []
    if copy:
        lines.append(f"d2d copy: {copy['tb_s']:.3f} TB/s ({copy['ms']:.3f} ms for {copy['bytes'] / 1e9:.2f} GB);"
                     f" read ceiling {read_ceiling_bps() / 1e12:.2f} TB/s")
    lines += [HEADER, "-" * len(HEADER), format_rows(records)]
    return "\n".join(lines)


def format_rows(records: list[dict]) -> str:
    """One line per record (time '-' and a FAIL/ERROR/SKIPPED status where it did not pass)."""
    lines = []
    for r in records:
        if r.get("impl") == "d2d_copy":
            continue
        kn = f"{r['K']}x{r['N']}" if r.get("K") else ""
        variant = (r.get("variant") or "")[:28]
        if r.get("best"):
            variant = ("*" + variant)[:28]
        if r.get("ms") is not None:
            fx = lambda v: f"{v:6.2f}" if v else f"{'':6s}"  # noqa: E731
            nums = (f"{r['ms'] * 1e3:9.2f} {r['bytes'] / 1e6:8.2f} {r['tb_s']:6.3f} "
                    f"{100 * r['frac_ceiling']:5.1f}% {fx(r.get('speedup_vs_bf16'))} "
                    f"{fx(r.get('speedup_vs_tinygemm'))}")
        else:
            nums = f"{'-':>9s} {'':8s} {'':6s} {'':6s} {'':6s} {'':6s}"
        status = r.get("status") or ""
        if r.get("impl") == "xla_dq" and r.get("xla_fusion"):
            status += f"  [{r['xla_fusion']['verdict']}]"
        if status.startswith("FAIL"):
            status = "FAIL " + status[4:].strip()
        g = r.get("G") if r.get("G") is not None else ""
        lines.append(f"{r.get('shape') or '':9s} {kn:>12s} {g:>3} {r.get('M') or '':>3} "
                     f"{r.get('impl') or '':11s} {variant:28s} {nums}  {status}")
    return "\n".join(lines)


PROG = "qspec-bench w4a16"


def build_parser() -> argparse.ArgumentParser:
    from qspec_jax.bench import options
    from qspec_jax.cli import HelpFormatter, Parser, comma_choices, comma_list

    ap = Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON to this file (default: none)")
    options.add_doc_arg(ap, "BENCHMARKS.md")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU smoke test)")
    ap.add_argument("--shapes", type=comma_list(str, "shape names"), default=None,
                    help=f"comma list of {','.join(BENCH_SHAPES)} (--quick: {','.join(QUICK_SHAPES)}) (default: all)")
    ap.add_argument("--m", type=comma_list(int), default="1,5,8,16", help="comma list of M values")
    ap.add_argument("--groups", type=comma_list(int), default="32,64,128", help="comma list of group sizes")
    ap.add_argument("--impls", type=comma_choices(BF16_IMPLS + INT4_IMPLS), default=None,
                    help=f"comma list of {','.join(BF16_IMPLS + INT4_IMPLS)} (default: {','.join(DEFAULT_IMPLS)})")
    ap.add_argument("--variants", action="store_true",
                    help="also time the Mosaic config / kernel variants (at the first M only)")
    ap.add_argument("--time-budget", type=float, default=900.0, help="seconds; later configs are skipped")
    ap.add_argument("--keep-parts", action="store_true",
                    help="keep the records of the (shape, M) pairs this run does not measure from the --out file "
                         "already there (`make bench-w4a16` runs one M and one model's shapes per ten-minute call)")
    return ap


def kept_records(path: Path, m_values: tuple[int, ...], shapes: tuple[str, ...] | None = None) -> list[dict]:
    """The records of an earlier `--out` file at `path` whose (shape, M) this run does not measure
    (`shapes` None: every shape is measured, so records are kept by M alone; the copy record and
    SKIPPED lines without an M are not kept), each marked with `kept_from` (that run's command); []
    without such a file. A file that is not a W4A16 result is refused by name."""
    from qspec_jax.bench import options

    def measured(r: dict) -> bool:
        return r["M"] in m_values and (shapes is None or r.get("shape") in shapes)

    def pick(old: dict[str, Any]) -> list[dict]:
        command = old["meta"]["command"]
        return [{**r, "kept_from": r.get("kept_from", command)} for r in old["records"]
                if isinstance(r.get("M"), int) and not measured(r)]

    return options.kept_from_earlier(path, "w4a16", pick, [])


def main(argv: list[str] | None = None) -> int:
    from qspec_jax.bench import options

    return options.run_bench(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    from qspec_jax.bench import options
    from qspec_jax.cli import fail, require_writable_file
    from qspec_jax.weight_quant import WEIGHT_GROUPS

    args = build_parser().parse_args(argv)
    quick = args.quick
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not quick and args.doc is not None:
        fail(PROG, f"--doc: no GPU ({jax.default_backend()} backend), so this would be the --quick smoke test, which "
                   "never rewrites a report")
    options.positive(PROG, args, "--m")
    bad = [g for g in args.groups if g not in WEIGHT_GROUPS]
    if bad:
        fail(PROG, f"--groups must each be one of {', '.join(map(str, WEIGHT_GROUPS))}, got {','.join(map(str, bad))}")
    if not args.time_budget > 0:
        fail(PROG, f"--time-budget must be > 0 seconds, got {args.time_budget}")
    options.resolve_doc(PROG, args, "BENCHMARKS.md", quick)
    if args.out is not None:
        require_writable_file(PROG, args.out, "--out")
    if not on_gpu and not quick:
        print("no GPU backend: running the quick (interpret-mode) smoke test instead", file=sys.stderr)
        quick = True
    shapes = None
    if args.shapes:
        table = QUICK_SHAPES if quick else BENCH_SHAPES
        unknown = [x for x in args.shapes if x not in table]
        if unknown:
            fail(PROG, f"--shapes {','.join(unknown)}: expected names from {','.join(table)}"
                       + (" (--quick and CPU runs use the tiny shapes)" if quick else ""))
        shapes = {x: table[x] for x in args.shapes}
    impls = tuple(args.impls) if args.impls else None
    kept: list[dict] = []
    if args.keep_parts:
        if args.out is None:
            fail(PROG, "--keep-parts needs --out (the file whose other M values are kept)")
        try:
            kept = kept_records(args.out, tuple(args.m), tuple(shapes) if shapes else None)
        except ValueError as e:
            fail(PROG, str(e))
    records = run(shapes=shapes, m_values=tuple(args.m), quick=quick, groups=tuple(args.groups),
                  time_budget_s=args.time_budget, impls=impls, variants=args.variants)
    print(format_table(records))
    records += kept
    command = options.command_line(PROG, argv)
    if args.out:
        meta = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                "jax_version": jax.__version__, "quick": quick, "command": command}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1, default=_json_default)
        print(f"wrote {args.out}")
    if args.doc:
        write_section(records, command, path=args.doc)
        print(f"rewrote the w4a16 section of {args.doc}")
    n_fail = sum(1 for r in records if str(r.get("status", "")).startswith(("FAIL", "ERROR")))
    return 1 if n_fail else 0


def summary_rows(records: list[dict]) -> list[list[Any]]:
    """One row per (shape, G, M): each implementation's best time (µs) and the Mosaic INT4 ratios."""
    by: dict[tuple, dict[str, dict]] = {}
    bf: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r.get("impl") in (None, "d2d_copy", "all") or not r.get("ms"):
            continue
        if r["impl"] in BF16_IMPLS:
            slot = bf.setdefault((r["shape"], r["M"]), {})
        else:
            slot = by.setdefault((r["shape"], r["G"], r["M"]), {})
        if r["impl"] not in slot or r["ms"] < slot[r["impl"]]["ms"]:
            slot[r["impl"]] = r
    rows = []
    us = lambda d, i: d[i]["ms"] * 1e3 if i in d else float("nan")  # noqa: E731
    order = {name: i for i, name in enumerate([*BENCH_SHAPES, *QUICK_SHAPES])}
    # by M, then the shapes' table order (rows kept from earlier parts interleave with this run's)
    for (shape, g, m), d in sorted(by.items(), key=lambda kv: (kv[0][2], order.get(kv[0][0], len(order)), kv[0][1])):
        b = bf.get((shape, m), {})
        mi = d.get("mosaic_int4")
        rows.append([shape, f"{mi['K'] if mi else ''}x{mi['N'] if mi else ''}", g, m, us(b, "bf16"),
                     us(b, "mosaic_bf16"), us(d, "mosaic_int4"), us(d, "pallas"), us(d, "tinygemm"),
                     us(d, "gemlite"), (mi["floor_ms"] * 1e3) if mi else float("nan"),
                     100 * mi["frac_ceiling"] if mi else float("nan"),
                     us(b, "bf16") / us(d, "mosaic_int4") if mi else float("nan"),
                     us(d, "tinygemm") / us(d, "mosaic_int4") if mi else float("nan"),
                     us(b, "bf16") / us(b, "mosaic_bf16") if "mosaic_bf16" in b else float("nan")])
    return rows


def section_text(records: list[dict[str, Any]], env_line: str) -> str:
    """The W4A16 section's markdown: per (shape, G, M) every implementation's best time."""
    from qspec_jax.bench import report

    copy = next((x for x in records if x.get("impl") == "d2d_copy"), None)
    copy_txt = f" Device-to-device copy in the same run: {copy['tb_s']:.2f} TB/s;" if copy else ""
    # (shape, M) pairs kept from earlier runs (--keep-parts), by command; an M this run also measured is
    # named with the shapes kept for it
    fresh_m = {r["M"] for r in records if "kept_from" not in r and isinstance(r.get("M"), int)}
    origins: dict[str, dict[int, list[str]]] = {}
    for r in records:
        if "kept_from" in r:
            shapes = origins.setdefault(r["kept_from"], {}).setdefault(r["M"], [])
            if r.get("shape") not in shapes:
                shapes.append(r.get("shape"))
    kept_txt = "".join(
        " Rows of " + "; ".join(f"M = {m}" + (f" ({', '.join(by_m[m])})" if m in fresh_m else "") for m in sorted(by_m))
        + f" kept from an earlier run: `{cmd}`." for cmd, by_m in origins.items())
    headers = ["shape", "K×N", "G", "M", "cuBLAS bf16 µs", "Mosaic bf16 µs", "Mosaic INT4 µs", "Triton INT4 µs",
               "tinygemm µs", "gemlite µs", "INT4 floor µs", "Mosaic INT4 % ceiling", "INT4 vs cuBLAS",
               "INT4 vs tinygemm", "cuBLAS / Mosaic bf16"]
    return ("## INT4 draft linears (W4A16)\n\n" + env_line + "." + copy_txt
            + f" read ceiling {read_ceiling_bps() / 1e12:.2f} TB/s. Median of 5 trials of in-device loops over rotating "
            "weight copies (torch peers: CUDA-graph replay of the same ops); each implementation's best measured "
            "config. Floor = INT4 bytes / read ceiling." + kept_txt + "\n\n" + report.table(headers, summary_rows(records)))


def write_section(records: list[dict[str, Any]], command: str, env_line: str | None = None,
                  path: Path | None = None) -> None:
    """Rewrites the "w4a16" section of `path` (docs/BENCHMARKS.md by default; `env_line`: for
    records measured elsewhere, e.g. loaded with --from-json; default: this process's environment)."""
    from qspec_jax.bench import report

    report.update_section("w4a16", section_text(records, env_line or report.env_line(report.environment(), command)),
                          path or report.BENCHMARKS_MD)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, (jnp.dtype, np.dtype, type)):
        return str(o)
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
