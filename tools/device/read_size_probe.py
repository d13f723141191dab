"""How fast can any kernel read N bytes on this GPU, as a function of N? (issue 32: the INT4 linears read
17-30 MB-scale weights in ~20 us kernels; is ~70% of the ceiling a property of our ring or of the size?)
Times XLA's reduction of a uint32 array (one kernel per call, chained over enough copies to defeat the L2,
the same harness as w4a16_config_sweep.py) from 4 MB to 1 GB, and prints the rate against the read ceiling
and a fit t = t0 + bytes / rate over the sizes. Not in CI.

    PYTHONPATH=. python3 tools/device/read_size_probe.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402

L2_DEFEAT = 240 << 20


def time_reads(nbytes: int) -> float:
    rows = nbytes // 4 // 4096
    copies = max(1, min(16, -(-L2_DEFEAT // nbytes)))
    xs = [jax.random.bits(jax.random.PRNGKey(c), (rows, 4096), jnp.uint32) for c in range(copies)]
    iters = max(2, int(4e-3 / (nbytes / 3e12) / copies))

    def f(xs):
        def body(i, acc):
            xs_i, _ = lax.optimization_barrier((xs, i))
            prev = acc
            for x in xs_i:
                x, _ = lax.optimization_barrier((x, prev))
                prev = prev + jnp.sum(x, axis=0)  # [4096]: reads all of x once
            return prev
        return lax.fori_loop(0, iters, body, jnp.zeros((4096,), jnp.uint32))

    exe = jax.jit(f).lower(xs).compile()
    jax.block_until_ready(exe(xs))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(xs))
        ts.append((time.perf_counter() - t0) / (iters * copies))
    return statistics.median(ts)


def main() -> int:
    ceil = read_ceiling_bps()
    rows = []
    for mb in (4, 8, 16, 32, 64, 73, 128, 256, 512, 1024):
        n = mb << 20
        t = time_reads(n)
        rows.append((n, t))
        print(f"  {mb:5d} MB  {t * 1e6:9.2f} us  {n / t / 1e12:5.2f} TB/s  {n / t / ceil:5.0%} of the ceiling "
              f"({ceil / 1e12:.2f} TB/s)", flush=True)
    n, t = np.array([r[0] for r in rows], float), np.array([r[1] for r in rows], float)
    slope, t0 = np.polyfit(n, t, 1)
    print(f"fit: t = {t0 * 1e6:.2f} us + bytes / {1 / slope / 1e12:.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
