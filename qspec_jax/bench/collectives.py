"""The collectives of a tensor-parallel decode step, timed alone, and the floor they put under it.

A TP decode step all-reduces the row-parallel partial products twice per layer (after the
o-projection and after down: [rows, hidden] bf16, `spmd.sharded_matmul`). Those latencies do not
shrink with the device count, so the fastest a TP step can be is

    step floor = bytes read per device / copy bandwidth + layers x 2 x all-reduce latency

`allreduce_latency` times one all-reduce at a decode shape inside a device loop (as the step
runs it: back to back, no host in between), less an elementwise kernel of the same shape (what
each loop iteration costs besides the collective); `step_floor_s` is the formula above. Both go
into the "tp" part of `qspec-bench e2e`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from qspec_jax.bench.timing import time_loop
from qspec_jax.spmd import TP, shard_map, tp_size


def allreduce_latency(mesh: Mesh, rows: int, hidden: int, trials: int = 5) -> dict[str, Any]:
    """Seconds per all-reduce (psum over the mesh's "tp" axis) of a [rows, hidden] bf16 array,
    each device holding a full partial, timed back to back inside one jitted loop.

    Returns {"devices", "rows", "hidden", "bytes", "allreduce_s" (one psum + the elementwise
    kernel that keeps the loop's value in range), "elementwise_s" (that kernel alone),
    "collective_s" (the difference, >= 0)}. Raises if the psum does not sum the devices'
    partials (a mesh whose collective is broken must not yield a latency).
    """
    n = tp_size(mesh)
    if rows < 1 or hidden < 1:
        raise ValueError(f"allreduce_latency: rows and hidden must be >= 1, got rows={rows}, hidden={hidden}")

    def psum(y: jax.Array) -> jax.Array:  # [rows, hidden] on every device -> the sum of the n copies
        return shard_map(lambda v: jax.lax.psum(v, TP), mesh, in_specs=P(), out_specs=P())(y)

    x = jnp.ones((rows, hidden), jnp.bfloat16)
    got = np.asarray(jax.jit(psum)(x * 0.5), np.float32)
    if not np.all(got == 0.5 * n):  # small integers times 0.5: exact in bf16
        raise RuntimeError(f"allreduce_latency: psum over {n} devices of 0.5 gave {np.unique(got)[:4]}, "
                           f"expected {0.5 * n}")
    # data = (scale, shift) as jit arguments, so XLA can fold neither kernel away; scale 1/n keeps
    # the loop's value near 1.
    data = (jnp.asarray(1.0 / n, jnp.bfloat16), jnp.asarray(0.0, jnp.bfloat16))
    reduced = time_loop(lambda y, d: psum(y) * d[0] + d[1], x, reps=64, trials=trials, data=data)
    local = time_loop(lambda y, d: y * d[0] + d[1], x, reps=64, trials=trials, data=data)
    return {"devices": n, "rows": rows, "hidden": hidden, "bytes": rows * hidden * 2,
            "allreduce_s": reduced["s"], "elementwise_s": local["s"],
            "collective_s": max(reduced["s"] - local["s"], 0.0)}


def step_floor_s(bytes_per_device: float, bandwidth: float, layers: int, allreduce_s: float) -> float:
    """The fastest a TP decode step can be: its bytes per device at the copy bandwidth (bytes/s)
    plus two all-reduces per layer."""
    if bandwidth <= 0:
        raise ValueError(f"step_floor_s: bandwidth must be > 0 bytes/s, got {bandwidth}")
    return bytes_per_device / bandwidth + layers * 2 * allreduce_s
