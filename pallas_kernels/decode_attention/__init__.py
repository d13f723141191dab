"""Decode attention over the QuantSpec hierarchical cache and a dense cache (one op, one folder).

* `api`: the entry (`cache_attention`, `attention_inputs`) and the dispatch by device (`choose_impl`).
* `mosaic_gpu`: the Hopper (sm_90) kernels' wrapper, code conversion and split merge, and issue 13's
  one-warpgroup schedule ("legacy"); `mosaic_gpu_ws`: the warp-specialized schedule, the default.
* `triton`: the Triton kernels (GPUs before Hopper; the dense AR-bf16 kernel on every GPU).
* Reference: the model's XLA path, `qspec_jax.attention.quantized_cache_attention`, is the oracle of
  every kernel test (CPU interpret mode and the GPU check script `tools/device/check_attention.py`).
"""

from pallas_kernels.decode_attention.api import (
    IMPLS,
    attention_inputs,
    cache_attention,
    choose_impl,
    is_hopper,
    query_operand_shape,
)
from pallas_kernels.decode_attention.mosaic_gpu import MgpuConfig, quantized_decode_attention_mgpu
from pallas_kernels.decode_attention.triton import (
    KernelConfig,
    dense_decode_attention,
    dense_operand_shape,
    merge_partials,
    quantized_decode_attention,
    rows_for,
)

__all__ = [
    "IMPLS",
    "KernelConfig",
    "MgpuConfig",
    "attention_inputs",
    "cache_attention",
    "choose_impl",
    "dense_decode_attention",
    "dense_operand_shape",
    "is_hopper",
    "merge_partials",
    "quantized_decode_attention",
    "quantized_decode_attention_mgpu",
    "query_operand_shape",
    "rows_for",
]
