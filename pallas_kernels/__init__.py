"""Pallas GPU kernels (Triton lowering) for qspec-jax.

`cache_attention(q, q_pos, cache, layer, *, view, sliding_window=None, interpret=None)` is the
entry `qspec_jax.attention.cache_attention` dispatches to. `interpret=None` runs Pallas'
interpreter unless `jax.default_backend() == "gpu"`.
"""

from pallas_kernels.decode_attention import (
    KernelConfig,
    cache_attention,
    dense_decode_attention,
    merge_partials,
    quantized_decode_attention,
    rows_for,
)

__all__ = [
    "KernelConfig",
    "cache_attention",
    "dense_decode_attention",
    "merge_partials",
    "quantized_decode_attention",
    "rows_for",
]
