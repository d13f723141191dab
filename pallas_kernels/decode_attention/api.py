"""Decode attention over the QuantSpec cache and a dense cache: the op's entry, dispatching by device.

`cache_attention(q, q_pos, cache, layer, *, view, sliding_window=None, interpret=None, impl="auto")` is what
`qspec_jax.attention.cache_attention` calls; `attention_inputs` gives the per-pass inputs a model computes once
outside its layer loop. Backends (`impl`): "mosaic" (`mosaic_gpu`, Hopper sm_90: the warp-specialized schedule
of `mosaic_gpu_ws` by default), "triton" (`triton`, GPUs before Hopper; its dense kernel serves the AR-bf16
baseline on every GPU); "auto" picks Mosaic GPU on Hopper where the call fits it. The reference (the oracle of
every kernel test) is the model's XLA path, `qspec_jax.attention.quantized_cache_attention`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels._common import interpret_default
from pallas_kernels.decode_attention.triton import (
    SUPPORTED_HEAD_DIMS,
    dense_decode_attention,
    dense_operand_shape,
    kernel_inputs,
    quantized_decode_attention,
)

Array = jax.Array
IMPLS = ("auto", "mosaic", "triton")  # cache_attention's backends ("auto": by device)


def is_hopper() -> bool:
    """The default device is an NVIDIA GPU of compute capability 9.x (the Mosaic GPU kernels)."""
    try:
        dev = jax.devices()[0]
        return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")
    except Exception:  # pragma: no cover - no devices
        return False


def choose_impl(impl: str, q: Array, cache: Any, view: str) -> str:
    """"mosaic" or "triton" for a QuantSpecCache call. "auto": Mosaic GPU on Hopper when the call
    fits it (16-bit activations and ring, head_dim 64/128, G a multiple of 64), else Triton."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    from pallas_kernels.decode_attention import mosaic_gpu as mg

    ok = (is_hopper() and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and mg.unsupported_reason(q.shape, cache, view) is None)
    return "mosaic" if ok else "triton"


def query_operand_shape(q: Any, cache: Any, *, view: str, impl: str = "auto") -> tuple[int, ...] | None:
    """The prepared query operand `cache_attention(q_operand=...)` takes for queries q [B, T, Hq, D]
    (an array or a ShapeDtypeStruct), [B, Hkv, D, CN] bf16 (column t n_rep + r: query head
    h n_rep + r of token t), or None where the call takes q itself: over a QuantSpecCache where
    the call runs the Mosaic kernel's warp-specialized schedule; over a bf16 DenseKVCache with
    bf16 queries (the Triton dense kernel: `triton.dense_operand_shape`)."""
    from qspec_jax.cache import DenseKVCache, QuantSpecCache  # lazy: keeps this module light

    if isinstance(cache, DenseKVCache):
        ok = (jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16) and cache.k.dtype == jnp.bfloat16
              and q.shape[3] in SUPPORTED_HEAD_DIMS)
        return dense_operand_shape(q.shape, cache.k.shape[2]) if ok else None
    if not isinstance(cache, QuantSpecCache) or choose_impl(impl, q, cache, view) != "mosaic":
        return None
    from pallas_kernels.decode_attention import mosaic_gpu as mg

    if not mg.takes_query_operand(q.shape, cache, view):
        return None
    return mg.query_operand_shape(q.shape, cache.k_hi.shape[2])


def attention_inputs(q: Any, q_pos: Array, cache: Any, *, view: str = "target", impl: str = "auto") -> dict[str, Array]:
    """The per-pass inputs of the kernel `cache_attention` picks for this call (positions per
    query row, per-row lengths), for a caller that attends every layer of a pass with the same
    positions: computed once, outside the layer loop, and passed to each call as `inputs=`.
    `q` may be a jax.ShapeDtypeStruct of the queries [B, T, Hq, D]."""
    from qspec_jax.cache import QuantSpecCache  # lazy: keeps this module light

    if isinstance(cache, QuantSpecCache):
        hkv = cache.k_hi.shape[2]
        if choose_impl(impl, q, cache, view) == "mosaic":
            from pallas_kernels.decode_attention import mosaic_gpu as mg

            return mg.kernel_inputs(q_pos, cache, q.shape[2] // hkv, view)
        return kernel_inputs(q_pos, cache, q.shape[2] // hkv)
    return kernel_inputs(q_pos, None, q.shape[2] // cache.k.shape[2])


def cache_attention(q: Array, q_pos: Array, cache: Any, layer: Array | int, *, view: str = "target",
                    sliding_window: int | None = None, interpret: bool | None = None,
                    config: Any = None, impl: str = "auto", inputs: dict[str, Array] | None = None,
                    q_operand: Array | None = None) -> Array:
    """Same semantics as `qspec_jax.attention.cache_attention` for both cache types.

    QuantSpecCache: `view` "draft" reads the upper planes only (INT4), "target" both (INT8);
    the FP ring is attended in the same launch. `impl`: "auto" (Mosaic GPU on Hopper, Triton
    elsewhere), "mosaic" or "triton"; `config` is that kernel's MgpuConfig / KernelConfig.
    `interpret=None` interprets unless the default backend is a GPU (the Mosaic kernel then
    runs its SMEM-operand twin). DenseKVCache: `view` is ignored (Triton dense kernel).
    `inputs`: `attention_inputs(q, q_pos, cache, view=view, impl=impl)` of this pass, or None.
    `q_operand`: the queries already in the kernel's operand layout (`query_operand_shape`; q
    then gives only the shapes): the Mosaic kernel over a QuantSpecCache, the dense kernel.
    """
    from qspec_jax.cache import DenseKVCache, QuantSpecCache  # lazy: keeps this module light

    if isinstance(cache, QuantSpecCache):
        if view not in ("draft", "target"):
            raise ValueError(f"view={view!r}; expected 'draft' or 'target'")
        if choose_impl(impl, q, cache, view) == "mosaic":
            from pallas_kernels.decode_attention import mosaic_gpu as mg

            return mg.quantized_decode_attention_mgpu(q, q_pos, cache, layer, view=view, sliding_window=sliding_window,
                                                      interpret=interpret_default(interpret), config=config,
                                                      inputs=inputs, q_operand=q_operand)
        if q_operand is not None:
            raise ValueError("q_operand: only the Mosaic GPU kernel takes a prepared query operand")
        return quantized_decode_attention(q, q_pos, cache, layer, view=view, sliding_window=sliding_window,
                                          interpret=interpret, config=config, inputs=inputs)
    if isinstance(cache, DenseKVCache):
        return dense_decode_attention(q, q_pos, cache.k, cache.v, layer, sliding_window=sliding_window,
                                      interpret=interpret, config=config, inputs=inputs, q_operand=q_operand)
    raise TypeError(f"unsupported cache type {type(cache).__name__}")
