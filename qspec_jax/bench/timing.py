"""Device timing for benchmarks (SPEC §7): many repetitions inside one jitted loop, median of
trials, and the device-to-device copy bandwidth every achieved bandwidth is compared with."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

# Bytes/s a kernel can read at best, by GPU: the H200's measured (a bf16 GEMV through cuBLAS reads
# the 1.05 GB lm_head at 4.35 TB/s, SPEC §8) and the H100 SXM's datasheet bandwidth (3.35 TB/s; not
# measured here). Any other device (a CPU run, where no GPU kernel is timed) reports against the H200's.
READ_CEILINGS_BPS = {"H200": 4.35e12, "H100": 3.35e12}


def read_ceiling_bps(device_kind: str | None = None) -> float:
    """The read ceiling (bytes/s) of `device_kind` (a `Device.device_kind` such as "NVIDIA H100
    80GB HBM3"; default: the first device's) from READ_CEILINGS_BPS; the H200's for others."""
    kind = (device_kind if device_kind is not None else jax.devices()[0].device_kind).upper()
    return next((bps for name, bps in READ_CEILINGS_BPS.items() if name in kind), READ_CEILINGS_BPS["H200"])


def time_loop(step: Callable, q0: Any, reps: int, trials: int, target_s: float = 0.03, data: Any = (),
              trace_dir: Any = None) -> dict:
    """Median seconds per `step` call; step(q, data) -> q' (same shape) runs `reps` times per
    trial inside one jitted fori_loop (grown until a trial takes ~target_s). `data` (caches,
    weights) is passed as a jit argument, never captured as a constant. With `trace_dir`, one more
    run of `reps` steps under `jax.profiler` adds "kernels": {GPU kernel name: microseconds per
    step} (what the GPU spent in each kernel, without launch gaps; {} on a CPU)."""

    @jax.jit
    def run(q, n, data):
        return jax.lax.fori_loop(0, n, lambda i, x: step(x, data), q)

    jax.block_until_ready(run(q0, 1, data))
    t0 = time.perf_counter()
    jax.block_until_ready(run(q0, reps, data))
    est = (time.perf_counter() - t0) / reps
    reps = int(max(reps, min(5000, target_s / max(est, 1e-7))))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(run(q0, reps, data))
        times.append((time.perf_counter() - t0) / reps)
    out = {"s": statistics.median(times), "reps": reps, "trials": trials, "spread": (max(times) - min(times)) / 2}
    if trace_dir is not None:
        from pathlib import Path

        from qspec_jax.bench.profile import kernel_events  # lazy: profile imports this module's users

        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            jax.block_until_ready(run(q0, reps, data))
        kernels: dict[str, float] = {}
        for e in kernel_events(Path(trace_dir)):
            kernels[e["name"]] = kernels.get(e["name"], 0.0) + e["dur_us"] / reps
        out["kernels"] = kernels
    return out


def copy_bandwidth(nbytes: int, trials: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    Each pass writes y = x * s out of place (x read once, y written once; s changes per pass so
    nothing is hoisted). Two loop lengths are timed and differenced, so per-call costs cancel.
    """
    n = nbytes // 4
    x = jnp.arange(n, dtype=jnp.float32) % 7.0

    @functools.partial(jax.jit, static_argnums=1)
    def run(x, passes):
        def body(i, y):
            return x * (1.0 + (i % 2).astype(jnp.float32)) + y[0] * 0.0
        return jax.lax.fori_loop(0, passes, body, jnp.zeros_like(x))

    short, long = 4, 24
    per_call = {}
    for passes in (short, long):
        jax.block_until_ready(run(x, passes))
        times = []
        for _ in range(trials):
            t0 = time.perf_counter()
            jax.block_until_ready(run(x, passes))
            times.append(time.perf_counter() - t0)
        per_call[passes] = statistics.median(times)
    per_pass = max((per_call[long] - per_call[short]) / (long - short), 1e-12)
    return 2 * nbytes / per_pass
