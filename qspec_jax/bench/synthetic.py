"""Caches filled with random data, for benchmarks: timing does not depend on the values, and a
prefill of 128k tokens would only add minutes of setup. Never zeros (they can run faster)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qspec_jax.cache import DenseKVCache, QuantSpecCache, prefill_quantized_len
from qspec_jax.config import ModelConfig


def attention_config(hq: int, hkv: int, d: int, layers: int = 1) -> ModelConfig:
    """A model of just these attention heads (hq query, hkv KV heads of head dim d; bfloat16): what a
    synthetic cache and an attention kernel's call need, for kernel benchmarks and checks."""
    return ModelConfig(vocab_size=8, hidden_size=hq * d, intermediate_size=8, num_layers=layers, num_heads=hq,
                       num_kv_heads=hkv, head_dim=d, dtype="bfloat16")


def random_dense_cache(cfg: ModelConfig, batch: int, context: int, key: jax.Array, *, extra_slots: int = 0,
                       layers: int | None = None, lengths: jax.Array | None = None) -> DenseKVCache:
    """A dense cache holding `context` random tokens per row (or `lengths` int32[B] <= context,
    rows of different lengths), with `extra_slots` free slots past `context`."""
    shape = (layers or cfg.num_layers, batch, cfg.num_kv_heads, context + extra_slots, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    fill = jax.jit(lambda k: (jax.random.normal(k, shape, dtype), jax.random.normal(jax.random.fold_in(k, 1), shape, dtype)))
    k, v = fill(key)
    return DenseKVCache(k=k, v=v, lengths=_lengths(batch, context, lengths))


def _lengths(batch: int, context: int, lengths: jax.Array | None) -> jax.Array:
    if lengths is None:
        return jnp.full((batch,), context, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be int32[{batch}], got shape {lengths.shape}")
    return lengths


def random_quant_cache(cfg: ModelConfig, batch: int, context: int, key: jax.Array, *, extra_slots: int = 0,
                       layers: int | None = None, group: int = 128, gamma_max: int = 8,
                       fp_start: int = 0, lengths: jax.Array | None = None) -> QuantSpecCache:
    """A hierarchical cache laid out as after a prefill of `context` random tokens per row (or
    `lengths` int32[B] <= context): q_len = G*(length//G - 1) quantized, the rest in the ring
    starting at slot `fp_start`. `layers` overrides the layer count (kernel benchmarks rotate
    through a few copies)."""
    cfg = cfg.replace(num_layers=layers or cfg.num_layers)
    max_len = -(-(context + extra_slots) // group) * group
    empty = jax.eval_shape(lambda: QuantSpecCache.init(cfg, batch, max_len, group, gamma_max))

    @jax.jit
    def fill(k):
        leaves, treedef = jax.tree.flatten(empty)
        out = []
        for i, leaf in enumerate(leaves):
            ki = jax.random.fold_in(k, i)
            if leaf.dtype == jnp.uint8:  # random codes in both nibbles
                out.append(jax.random.bits(ki, leaf.shape, jnp.uint8))
            elif leaf.dtype == jnp.int32:
                out.append(jnp.zeros(leaf.shape, jnp.int32))
            else:  # scales small and positive, zeros and ring values O(1)
                out.append(jax.random.uniform(ki, leaf.shape, jnp.float32, 0.01, 0.2).astype(leaf.dtype))
        return jax.tree.unflatten(treedef, out)

    cache = fill(key)
    lengths = _lengths(batch, context, lengths)
    q = prefill_quantized_len(lengths, group)
    return cache.replace(q_len=q, fp_len=lengths - q, fp_start=jnp.full_like(q, fp_start % cache.ring_size))
