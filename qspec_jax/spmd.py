"""Tensor-parallel primitives: the mesh axis, per-device `shard_map` calls of kernels XLA cannot
partition, and the partition specs they need. Low-level on purpose: `linear` and `attention`
call into here, and `sharding` (which lays a whole model out) builds on it, so no module of
the model imports the layout code and there is no import cycle.

Layout (N devices on the one mesh axis "tp"): column-parallel weights [.., Din, Dout] split Dout,
row-parallel ones split Din and all-reduce their partial products; every cache array
[L, B, Hkv, ...] splits KV heads.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

TP = "tp"


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def weight_spec(row_parallel: bool, stacked: bool) -> P:
    """Spec of a linear weight [L?, Din, Dout]: Dout split (column-parallel) or Din (row-parallel)."""
    lead = (None,) if stacked else ()
    return P(*lead, TP, None) if row_parallel else P(*lead, None, TP)


def cache_specs(cache: Any) -> Any:
    """Every [L, B, Hkv, ...] cache array split along KV heads; per-row lengths replicated."""
    return jax.tree.map(lambda x: P(None, None, TP) if x.ndim >= 3 else P(), cache)


def shard_map(fn: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`jax.shard_map` (jax >= 0.7) with replication checks off: kernels are opaque to them."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def sharded_cache_attention(attend: Callable, mesh: Mesh, q: jax.Array, q_pos: jax.Array, cache: Any,
                            layer: jax.Array, inputs: Any = None) -> jax.Array:
    """Runs `attend(q, q_pos, cache, layer, inputs)` per device on its local query and KV heads
    (`inputs`, the kernels' per-row arrays, are replicated; refs among them, such as the in-kernel split
    merge's counters, stay outside: a ref loses its memory space in shard_map, and each device's call
    makes its own)."""
    if inputs:
        inputs = {k: v for k, v in inputs.items() if not isinstance(v, jax.ref.Ref)}
    head = P(None, None, TP)
    specs = (head, P(), cache_specs(cache), P(), jax.tree.map(lambda _: P(), inputs))
    return shard_map(attend, mesh, in_specs=specs, out_specs=head)(q, q_pos, cache, layer, inputs)


def sharded_matmul(matmul: Callable, mesh: Mesh, x: jax.Array, w: Any, layer: jax.Array | None,
                   row_parallel: bool) -> jax.Array:
    """`matmul(x, w, layer)` per device on its local slice of `w` (a dense array or an INT4
    weight pytree, one layer or stacked with `layer`): column-parallel gives output columns
    sharded; row-parallel consumes x sharded on its last dim and all-reduces the partial products.

    Dense weights go through here too, so each device runs an ordinary local dot whose shape the
    model controls (left to XLA's partitioner, M = 1 dots became broadcast-multiply + reduce
    fusions, docs/BENCHMARKS.md).
    """
    stacked = layer is not None
    spec = weight_spec(row_parallel, stacked)
    wspec = jax.tree.map(lambda _: spec, w)
    last = P(*([None] * (x.ndim - 1)), TP)
    if not stacked:
        layer = np.int32(0)  # shard_map needs an array; unused by a one-layer weight
    if row_parallel:
        def local(x, w, i):
            return jax.lax.psum(matmul(x, w, i if stacked else None), TP)
        return shard_map(local, mesh, in_specs=(last, wspec, P()), out_specs=P())(x, w, layer)

    def column(x, w, i):
        return matmul(x, w, i if stacked else None)
    return shard_map(column, mesh, in_specs=(P(), wspec, P()), out_specs=last)(x, w, layer)
