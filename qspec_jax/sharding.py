"""Tensor parallelism over a 1-D device mesh (axis "tp") with JAX's own SPMD machinery.

Layout (N devices):

    embed [V, D]                vocabulary-sharded            lm_head [D, V]    vocabulary-sharded
    wq, wk, wv [L, D, H*Dh]     column-parallel (heads)       wo [L, Hq*Dh, D]  row-parallel
    w_gate, w_up [L, D, F]      column-parallel               w_down [L, F, D]  row-parallel
    INT4 draft weights          as their dense twins (packed, scale and zero alike)
    every cache array [L, B, Hkv, ...]   sharded along KV heads; lengths replicated
    norms                       replicated

The collectives are the ones the math needs: an all-reduce after each row-parallel matmul (wo,
w_down) and, from XLA's partitioner, for the embedding gather; logits stay vocabulary-sharded until sampling
reduces over them. The Pallas kernels, which XLA cannot partition, run per device on their local
heads inside `shard_map` (attention) or `shard_map` + psum (row-parallel matmuls); dense matmuls
take the same per-device route (`spmd.sharded_matmul`; the per-device primitives live in
`qspec_jax.spmd`, below the model, so the model never imports this layout module).

Requirements: num_heads, num_kv_heads, intermediate_size and vocab_size divisible by N, and for
row-parallel INT4 weights each device's input slice a multiple of the draft group size. KV
heads are not replicated when N > num_kv_heads: that is refused with a clear error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qspec_jax import model as M
from qspec_jax.config import ModelConfig
from qspec_jax.spmd import TP, cache_specs, tp_size, weight_spec
from qspec_jax.weight_quant import QuantizedWeight

COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up")
ROW_PARALLEL = ("wo", "w_down")


class ShardingError(ValueError):
    """The model cannot be laid out on this mesh."""


def make_mesh(n: int | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A 1-D mesh named "tp" over the first n local devices (all by default)."""
    devices = list(devices if devices is not None else jax.local_devices())
    n = n or len(devices)
    if n > len(devices):
        hint = (f" (a CPU is split into {n} devices by XLA_FLAGS=--xla_force_host_platform_device_count={n}, set "
                "before jax is imported)" if devices and devices[0].platform == "cpu" else "")
        raise ShardingError(f"make_mesh({n}): only {len(devices)} device(s) available{hint}")
    return Mesh(np.array(devices[:n]), (TP,))


def check_divisible(cfg: ModelConfig, n: int, draft_group: int | None = None) -> None:
    """Clear errors for sizes the layout cannot split over n devices."""
    if n <= 1:
        return
    for field, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                         ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if value % n:
            raise ShardingError(f"{field}={value} is not divisible by the tensor-parallel size {n}")
    if draft_group:
        for name, din in (("wo", cfg.num_heads * cfg.head_dim), ("w_down", cfg.intermediate_size)):
            if (din // n) % draft_group:
                raise ShardingError(
                    f"{name}: each device's input slice ({din // n}) is not a multiple of the draft group "
                    f"size {draft_group}")


# ----------------------------------------------------------------------------------- specs
def _weight_spec(name: str, stacked: bool) -> P:
    if name in COLUMN_PARALLEL or name == "lm_head":
        return weight_spec(row_parallel=False, stacked=stacked)
    if name in ROW_PARALLEL:
        return weight_spec(row_parallel=True, stacked=stacked)
    return P()


def param_specs(params: M.Params) -> M.Params:
    """PartitionSpecs shaped like `params` (the same pytree, specs at the leaves)."""

    def spec_for(name: str, w: Any, stacked: bool) -> Any:
        spec = _weight_spec(name, stacked)
        if isinstance(w, QuantizedWeight):
            return QuantizedWeight(packed=spec, scale=spec, zero=spec)
        return spec

    layers = params.layers.replace(**{n: spec_for(n, getattr(params.layers, n), True) for n in M.LINEAR_NAMES},
                                   attn_norm=P(), mlp_norm=P())
    lm_head = None if params.lm_head is None else spec_for("lm_head", params.lm_head, False)
    return params.replace(embed=P(TP, None), layers=layers, final_norm=P(), lm_head=lm_head)


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def constrain_cache(cache: Any, mesh: Mesh | None) -> Any:
    """Pins a cache created inside a jitted function to the head-sharded layout."""
    if tp_size(mesh) <= 1:
        return cache
    return jax.lax.with_sharding_constraint(cache, _named(mesh, cache_specs(cache)))


def shard_params(params: M.Params, mesh: Mesh, draft_group: int | None = None) -> M.Params:
    """Places params on the mesh by the layout above and records the mesh in them."""
    check_divisible(params.config, tp_size(mesh), draft_group)
    placed = jax.device_put(params, _named(mesh, param_specs(params)))
    return placed.replace(mesh=mesh)


def shard(model: Any, mesh: Mesh) -> Any:
    """The model (target and draft params) laid out on `mesh`; generate() then runs sharded."""
    group = model.draft_weights_config.group_size if getattr(model, "draft_params", None) is not None else None
    params = shard_params(model.params, mesh, group)
    draft = None if model.draft_params is None else shard_params(model.draft_params, mesh, group)
    return dataclasses.replace(model, params=params, draft_params=draft)
