"""Pallas GPU kernels for qspec-jax.

`cache_attention(q, q_pos, cache, layer, *, view, sliding_window=None, interpret=None, impl="auto")`
is the entry `qspec_jax.attention.cache_attention` dispatches to (with `attention_inputs(q, q_pos,
cache, view=...)`, the per-pass inputs a model computes once outside its layer loop): the Mosaic GPU kernels
(`decode_attention_mgpu`) on Hopper, the Triton kernels (`decode_attention`) elsewhere.
`interpret=None` runs Pallas' interpreter unless `jax.default_backend() == "gpu"`.
"""

from pallas_kernels.decode_attention import (
    IMPLS,
    KernelConfig,
    attention_inputs,
    cache_attention,
    choose_impl,
    dense_decode_attention,
    is_hopper,
    merge_partials,
    quantized_decode_attention,
    rows_for,
)
from pallas_kernels.decode_attention_mgpu import MgpuConfig, quantized_decode_attention_mgpu

__all__ = [
    "IMPLS",
    "KernelConfig",
    "MgpuConfig",
    "attention_inputs",
    "cache_attention",
    "choose_impl",
    "dense_decode_attention",
    "is_hopper",
    "merge_partials",
    "quantized_decode_attention",
    "quantized_decode_attention_mgpu",
    "rows_for",
]
